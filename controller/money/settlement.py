"""Settlement: the double-entry side of the ledger, and what providers are owed.

Every ledger entry (a tenant's charge, or the platform's credit of a held quote's overrun) is
matched by postings that sum to zero: the tenant's debit, the credit of the provider whose
resources ran (GPUs on its cluster, bytes out of its cluster's uplink) less the platform's fee,
and the platform's share. A cluster without a provider is the operator's: the platform takes
the whole charge. The platform bears a held quote's overrun: the provider is paid for what ran.
`split` is the one rule, pure; `post` writes it in the entry's transaction.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.money.amounts import exact_total, q6
from controller.store.models import Cluster, LedgerEntry, Payout, Posting, Provider, utcnow
from controller.values.errors import Conflict

PLATFORM = "platform"


@dataclass(frozen=True)
class Side:
    """One posting of an entry: an account (tenant, provider, platform), its party and amount."""

    account: str
    party_id: str | None
    amount: Decimal


def split(
    amount: Decimal, tenant_id: str, kind: str, owner: tuple[str, Decimal] | None
) -> tuple[Side, ...]:
    """The postings of a ledger entry of `amount`, summing to zero exactly. `owner`: the
    provider whose resources the entry charges and its fee rate (None: the operator's own,
    or a platform credit). The provider's part is rounded to the micro-dollar (half-even);
    the platform keeps the exact remainder, so nothing is created or lost by rounding."""
    amount = q6(amount)
    tenant = Side("tenant", tenant_id, -amount)
    if owner is None or kind == "credit":
        return (tenant, Side(PLATFORM, None, amount))
    provider_id, fee_rate = owner
    net = q6(amount * (Decimal(1) - fee_rate))
    return (tenant, Side("provider", provider_id, net), Side(PLATFORM, None, amount - net))


def owners(session: Session) -> dict[str, tuple[str, Decimal]]:
    """Cluster name -> (provider id, fee rate) of every cluster a provider owns."""
    rows = session.execute(
        select(Cluster.name, Provider.id, Provider.fee_rate).join(
            Provider, Provider.id == Cluster.provider_id
        )
    ).all()
    return {name: (pid, Decimal(str(rate))) for name, pid, rate in rows}


def post(
    session: Session, entries: Sequence[LedgerEntry], clusters: Mapping[str, str]
) -> list[Posting]:
    """Write the postings of freshly added ledger entries (flushed: they have ids), in their
    transaction. `clusters`: each entry's usage id -> the cluster whose resources it charges
    (the GPUs' cluster, the link's source, or "platform")."""
    if not entries:
        return []
    owned = owners(session)
    made: list[Posting] = []
    for entry in entries:
        cluster = clusters.get(str(entry.usage_id), PLATFORM)
        for side in split(entry.amount, entry.tenant_id, entry.kind, owned.get(cluster)):
            posting = Posting(
                ledger_id=entry.id,
                account=side.account,
                party_id=side.party_id,
                cluster=cluster,
                kind=entry.kind,
                amount=side.amount,
                at=entry.period_end,
            )
            session.add(posting)
            made.append(posting)
    session.flush()
    return made


@dataclass(frozen=True)
class StatementLine:
    """A provider's earnings on one cluster for one kind of charge within a period."""

    cluster: str
    kind: str
    gross: Decimal  # what tenants paid for it
    fee: Decimal  # the platform's share
    net: Decimal  # credited to the provider


@dataclass(frozen=True)
class Statement:
    provider: str
    start: datetime | None
    end: datetime
    lines: tuple[StatementLine, ...]
    gross: Decimal
    fee: Decimal
    net: Decimal
    paid: Decimal  # payouts within the period
    balance: Decimal  # all credits to date less all payouts to date: what is owed now


def statement(
    session: Session, provider: Provider, start: datetime | None, end: datetime
) -> Statement:
    """What `provider` earned on its clusters in [start, end) (by the charged periods' ends),
    gross, fee and net per cluster and kind, its payouts in the period, and its balance."""
    credits = session.execute(
        select(Posting.ledger_id, Posting.cluster, Posting.kind, Posting.amount).where(
            Posting.account == "provider",
            Posting.party_id == provider.id,
            Posting.at < end,
            *([Posting.at >= start] if start is not None else []),
        )
    ).all()
    gross_of = _gross(session, [row.ledger_id for row in credits])
    by: dict[tuple[str, str], list[Decimal]] = defaultdict(lambda: [Decimal(0), Decimal(0)])
    for ledger_id, cluster, kind, amount in credits:
        net = q6(Decimal(str(amount)))
        acc = by[(cluster, kind)]
        acc[0] += gross_of[ledger_id]
        acc[1] += net
    lines = tuple(
        StatementLine(cluster, kind, gross, gross - net, net)
        for (cluster, kind), (gross, net) in sorted(by.items())
    )
    paid = exact_total(
        session,
        Payout.amount,
        Payout.provider_id == provider.id,
        Payout.at < end,
        *([Payout.at >= start] if start is not None else []),
    )
    return Statement(
        provider=provider.name,
        start=start,
        end=end,
        lines=lines,
        gross=q6(sum((x.gross for x in lines), Decimal(0))),
        fee=q6(sum((x.fee for x in lines), Decimal(0))),
        net=q6(sum((x.net for x in lines), Decimal(0))),
        paid=q6(paid),
        balance=balance(session, provider.id),
    )


def _gross(session: Session, ledger_ids: Iterable[int]) -> dict[int, Decimal]:
    ids = sorted(set(ledger_ids))
    out: dict[int, Decimal] = {}
    for i in range(0, len(ids), 500):
        for lid, amount in session.execute(
            select(LedgerEntry.id, LedgerEntry.amount).where(LedgerEntry.id.in_(ids[i : i + 500]))
        ):
            out[lid] = q6(Decimal(str(amount)))
    return out


def balance(session: Session, provider_id: str) -> Decimal:
    """What the platform owes the provider now: its credits less its payouts."""
    earned = exact_total(
        session, Posting.amount, Posting.account == "provider", Posting.party_id == provider_id
    )
    paid = exact_total(session, Payout.amount, Payout.provider_id == provider_id)
    return q6(earned - paid)


def pay_out(
    session: Session, provider: Provider, amount: Decimal, reference: str, at: datetime | None
) -> Payout:
    """Record a payout of `amount` to `provider`; a 409 when it is more than is owed. The
    caller holds the provider's row locked, so two payouts never both pass the check."""
    amount = q6(amount)
    owed = balance(session, provider.id)
    if amount > owed:
        raise Conflict(
            f"provider {provider.name!r} is owed {owed}; a payout of {amount} exceeds it",
            field="amount",
        )
    payout = Payout(provider_id=provider.id, amount=amount, reference=reference, at=at or utcnow())
    session.add(payout)
    session.flush()
    return payout


def unbalanced(session: Session) -> list[int]:
    """Ledger entries whose postings do not sum to zero, or that have none: empty when the
    double-entry books hold."""
    sums: dict[int, Decimal] = defaultdict(Decimal)
    for lid, amount in session.execute(select(Posting.ledger_id, Posting.amount)):
        sums[lid] += q6(Decimal(str(amount)))
    entries = session.scalars(select(LedgerEntry.id)).all()
    return sorted(lid for lid in entries if lid not in sums or sums[lid] != 0) + sorted(
        lid for lid in sums if lid not in set(entries)
    )
