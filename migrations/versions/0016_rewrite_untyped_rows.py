"""rewrite rows written before typed args and the typed plan

Specs stored before a job's `args` were typed kept free-form knobs; plans stored before the
typed plan (quote options, a job's held quote) named their shares `placement`. Both were read
through shims that loosened the models for every row. This revision rewrites such rows once,
so the models read an old row as they read a new one, and the shims are gone:

- in `jobs.spec` and `quotes.spec`, an `args` key the typed args refuse (unknown, or a value
  out of its bounds) is dropped: the runtime already ignored it. Each key is judged alone by
  this release's `wire.spec.TrainArgs`, as the shim judged it;
- in `jobs.placement`, `jobs.held_price` and each of `quotes.options`, `placement` becomes
  `clusters`.

Rows already in the new shape are not written. Downgrading keeps the new shape (the old code
read it too).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-01 22:15:00
"""

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from pydantic import ValidationError

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _typed_args(spec: Any) -> Any:
    """`spec` with only the args the typed args accept; the same object when nothing goes."""
    from wire.spec import TrainArgs

    if not isinstance(spec, dict) or not isinstance(spec.get("args"), dict):
        return spec
    kept: dict[str, Any] = {}
    for key, value in spec["args"].items():
        if key not in TrainArgs.model_fields:
            continue
        try:
            TrainArgs.model_validate({key: value})
        except ValidationError:
            continue
        kept[key] = value
    return spec if kept == spec["args"] else {**spec, "args": kept}


def _clusters(plan: Any) -> Any:
    """A plan that names its shares `placement` with them named `clusters`."""
    if isinstance(plan, dict) and "clusters" not in plan and "placement" in plan:
        shares = plan["placement"]
        return {**{k: v for k, v in plan.items() if k != "placement"}, "clusters": shares}
    return plan


def _options(options: Any) -> Any:
    if not isinstance(options, dict) or not isinstance(options.get("options"), list):
        return options
    rewritten = [_clusters(o) for o in options["options"]]
    if all(a is b for a, b in zip(rewritten, options["options"], strict=True)):
        return options
    return {**options, "options": rewritten}


def upgrade() -> None:
    bind = op.get_bind()
    jobs = sa.table(
        "jobs",
        sa.column("id", sa.String),
        sa.column("spec", sa.JSON),
        sa.column("placement", sa.JSON),
        sa.column("held_price", sa.JSON),
    )
    quotes = sa.table(
        "quotes",
        sa.column("id", sa.String),
        sa.column("spec", sa.JSON),
        sa.column("options", sa.JSON),
    )
    rewrites = {"spec": _typed_args, "placement": _clusters, "held_price": _clusters}
    for row in bind.execute(sa.select(jobs)).mappings().all():
        changed = {c: f(row[c]) for c, f in rewrites.items() if f(row[c]) is not row[c]}
        if changed:
            bind.execute(jobs.update().where(jobs.c.id == row["id"]).values(**changed))
    rewrites = {"spec": _typed_args, "options": _options}
    for row in bind.execute(sa.select(quotes)).mappings().all():
        changed = {c: f(row[c]) for c, f in rewrites.items() if f(row[c]) is not row[c]}
        if changed:
            bind.execute(quotes.update().where(quotes.c.id == row["id"]).values(**changed))


def downgrade() -> None:
    pass  # the rewritten rows are in a shape the previous revision's code reads as well
