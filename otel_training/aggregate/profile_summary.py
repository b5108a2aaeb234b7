"""The run model's ``profiles`` section: each capture (training thread), what its
operators were (the worker) and the steps it recorded (the triggers' consumer), joined
when the summary is made."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from otel_training.aggregate.profile_ops import Caught, top_ops
from otel_training.aggregate.profile_triggers import PERIODIC_FACTOR, ProfileTriggers
from otel_training.aggregate.run_sections import Profile, ProfileOp, Profiles, ProfileStep
from otel_training.record.profile_capture import Capture

COMPILED_NOTE = (
    "torch.compile'd code shows as its compiled regions (Torch-Compiled Region, CompiledFunction) "
    "and their fused kernels, not as the model's aten operators"
)


def profiles_section(
    triggers: ProfileTriggers,
    captures: Sequence[Capture],
    caught: Mapping[int, Caught | str],
    off: str | None,
) -> Profiles:
    """``caught``: per capture sequence, its operators, or why they could not be read."""
    profiles = []
    for capture in captures:
        if not capture.stop_ns or (not capture.steps and capture.failure is None):
            continue  # (recording, or it recorded no step: the run ended first)
        facts = triggers.facts.get(capture.sequence, [])
        steps = tuple(
            ProfileStep(
                mode=f.mode,
                step=f.number,
                own_s=round(f.own_s, 6),
                ratio=None if not f.median_s else round(f.own_s / f.median_s, 3),
                slow=bool(f.median_s) and f.own_s > PERIODIC_FACTOR * (f.median_s or 0.0),
                covered=round(f.covered, 3),
            )
            for f in facts
        )
        detail = capture.request.detail
        own, median = detail.get("own_s"), detail.get("median_s")
        result = caught.get(capture.sequence)
        error = capture.failure
        top: tuple[ProfileOp, ...] = ()
        phases: dict[str, float] = {}
        device = None
        compiled = False
        events = 0
        if isinstance(result, Caught):
            ranked, per_phase = top_ops(result, [f.span for f in facts])
            top = tuple(
                ProfileOp(
                    phase=t.phase,
                    name=t.name,
                    s=round(t.s, 6),
                    share=round(t.share, 4),
                    phase_share=round(t.phase_share, 4),
                )
                for t in ranked
            )
            phases = {k: round(v, 6) for k, v in per_phase.items()}
            device, compiled, events = result.device, result.compiled, result.events
        elif isinstance(result, str):
            error = error or result
        profiles.append(
            Profile(
                trigger=capture.request.trigger,
                file=capture.path,
                steps=steps,
                trigger_step=detail.get("step"),
                trigger_own_s=None if own is None else round(own, 6),
                median_s=None if median is None else round(median, 6),
                ratio=None if own is None or not median else round(own / median, 3),
                period=detail.get("period"),
                captured_slow=any(s.slow for s in steps) if steps else None,
                device=device,
                compiled=compiled,
                note=COMPILED_NOTE if compiled else None,
                recording_s=round((capture.stop_ns - capture.start_ns) / 1e9, 6),
                events=events,
                top=top,
                phases=phases,
                error=error,
            )
        )
    return Profiles(
        triggers=tuple(sorted(triggers.triggers)),
        max_ratio=round(triggers.max_ratio, 3) if triggers.max_ratio else None,
        requested=triggers.requested,
        profiles=tuple(profiles),
        off=off,
    )
