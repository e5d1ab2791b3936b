"""Amounts of money: kept to 6 decimals, rounded half-even, summed exactly on both backends."""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import InstrumentedAttribute, Session

MICRO = Decimal("0.000001")


def q6(value: Decimal) -> Decimal:
    """Money and quantities are kept to 6 decimals, rounded half-even (banker's rounding)."""
    return value.quantize(MICRO, rounding=ROUND_HALF_EVEN)


def exact_total(
    session: Session, column: InstrumentedAttribute[Any], *where: ColumnElement[bool]
) -> Decimal:
    """The exact sum of a money column. PostgreSQL sums NUMERIC exactly; SQLite stores it as
    a float and would sum floats, so there the rows are read (each exact to 6 places) and added
    as decimals."""
    if session.get_bind().dialect.name == "sqlite":
        return sum(
            (q6(Decimal(v)) for v in session.scalars(select(column).where(*where))), Decimal(0)
        )
    return Decimal(session.scalar(select(func.coalesce(func.sum(column), 0)).where(*where)) or 0)
