"""The job state diagram beside the jobs code is the one the transition table generates."""

from __future__ import annotations

from pathlib import Path

from grammar.states import TRANSITIONS, JobState, job_state_diagram

README = Path(__file__).resolve().parents[2] / "controller" / "jobs" / "README.md"


def test_the_readme_shows_the_generated_diagram() -> None:
    assert f"```mermaid\n{job_state_diagram()}\n```" in README.read_text()


def test_the_diagram_has_every_transition_and_no_other() -> None:
    edges = {
        tuple(line.strip().split(" --> "))
        for line in job_state_diagram().splitlines()[1:]
        if "[*]" not in line
    }
    table = {(a.value, b.value) for a, nxt in TRANSITIONS.items() for b in nxt}
    assert edges == table
    assert f"[*] --> {JobState.PENDING.value}" in job_state_diagram()
