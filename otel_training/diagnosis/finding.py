"""``Finding``: one diagnosis of a run, with its share of step time and advice."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Finding:
    """One diagnosis: ``kind`` is a stable identifier, ``score`` the share it explains."""

    kind: str
    score: float
    title: str
    detail: str
    advice: list[str] = field(default_factory=list)
    phase: str | None = None
    rank: int | None = None

    @property
    def severity(self) -> str:
        if self.kind == "balanced":
            return "info"
        if self.kind == "memory_creep":  # no share of step time: heading for an out-of-memory error
            return "high"
        return "high" if self.score >= 0.4 else "medium" if self.score >= 0.2 else "low"

    def line(self) -> str:
        """The one-line verdict: ``title: detail``."""
        return f"{self.title}: {self.detail}"

    def to_dict(self) -> dict:
        out = asdict(self)
        out["severity"] = self.severity
        return out


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"
