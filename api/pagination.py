"""Limit/offset pagination shared by every list endpoint."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Query
from pydantic import BaseModel
from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

T = TypeVar("T")


class PageParams(BaseModel):
    limit: int
    offset: int


async def page_params(
    limit: Annotated[int, Query(ge=1, le=500, description="Items per page.")] = 100,
    offset: Annotated[int, Query(ge=0, le=10_000_000, description="Items to skip.")] = 0,
) -> PageParams:
    return PageParams(limit=limit, offset=offset)


PageDep = Annotated[PageParams, Depends(page_params)]


def fetch_page(
    session: Session,
    stmt: Select[Any],
    page: PageParams,
    count: Select[Any] | None = None,
) -> tuple[Sequence[Any], int]:
    """The page of `stmt`, and how many rows it has in all: counted by `count` when given (a
    plain `SELECT count(*) ... WHERE` an index answers), else over `stmt` as a subquery.
    Items are the statement's first entity."""
    if count is None:
        count = select(func.count()).select_from(stmt.order_by(None).subquery())
    total = session.scalar(count) or 0
    window = stmt.limit(page.limit).offset(page.offset)
    items = session.scalars(window).unique().all()
    return items, int(total)
