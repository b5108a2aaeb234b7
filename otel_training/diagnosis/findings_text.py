"""The verdict and the step-detection self-check as text: the run-end table, ``otel-training
report`` and the line printed at exit."""

from __future__ import annotations

from collections.abc import Sequence

from otel_training.aggregate.run_model import CheckFinding
from otel_training.diagnosis.finding import Finding
from otel_training.diagnosis.formatting import share_pct


def render_findings(findings: Sequence[Finding], limit: int = 3) -> list[str]:
    """The verdict line, then each top finding with its share, detail and advice."""
    lines = [verdict_line(findings)]
    if not findings:
        return lines
    for i, f in enumerate(findings[:limit], 1):
        lines.append(
            f"  {i}. [{f.severity}] {f.title} ({share_pct(f.score)} of step time)"
            if f.score
            else f"  {i}. [{f.severity}] {f.title}"
        )
        lines.append(f"     {f.detail}")
        lines.extend(f"     - {a}" for a in f.advice)
    return lines


def verdict_line(findings: Sequence[Finding]) -> str:
    """``verdict: <title>: <detail>`` for the first finding."""
    return "verdict: " + (findings[0].line() if findings else "no data")


def verdict_lines(finding: Finding, advice: int = 3) -> list[str]:
    """The run-end table's verdict: the top finding and its first advice."""
    detail = finding.detail
    return [f"verdict: {finding.title}" + (f" ({detail})" if detail else "")] + [
        f"  - {a}" for a in finding.advice[:advice]
    ]


def self_check_lines(finding: CheckFinding, indent: str = "", who: str = "") -> list[str]:
    """A self-check finding (step detection in doubt) and its fix, for tables."""
    return [f"{indent}step detection in doubt{who}: {finding.cause}", f"{indent}  fix: {finding.fix}"]


def self_check_line(finding: CheckFinding) -> str:
    """The one line printed at exit for a self-check finding."""
    return f"otel-training: step detection in doubt: {finding.cause}; fix: {finding.fix}"
