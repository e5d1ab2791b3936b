"""providers, bandwidth_prices, slas, postings, payouts: providers as parties, double entry

A provider owns clusters (`clusters.provider_id`, assigned by admins), posts its offers into
the effective-dated catalogue (`provider_id` on `gpu_prices` and `egress_prices`: who posted a
row; a GPU offer may sell at most `gpus` at once, stop taking placements at `until` and bill
a run at least `min_hours` of each GPU) and is credited for what runs on its clusters, less
the platform's fee. Every ledger entry now has postings that sum to zero: the tenant's debit,
the provider's credit and the platform's share (issue 52). Reserved WAN rate is priced per
Gbit/s-hour on a cluster's ports (`bandwidth_prices`), so a job's bundle is GPUs and the
bandwidth between them. An SLA states what a provider promises of a cluster (uptime, uplink
bandwidth) and the share of a run's charges there refunded when the agents' measurements
show less. Postings and payouts are append-only in the database, like the ledger. Ledger
entries written before this revision get their postings here (all to the platform: no
cluster had a provider), so the books balance from the first entry.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-06 18:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

APPEND_ONLY = "the books are append-only: postings and payouts are never changed or deleted"
TABLES = ("postings", "payouts")


def _sqlite_triggers(table: str) -> tuple[str, ...]:
    return (
        f"""CREATE TRIGGER {table}_no_update BEFORE UPDATE ON {table}
BEGIN SELECT RAISE(ABORT, '{APPEND_ONLY} (UPDATE refused)'); END""",
        f"""CREATE TRIGGER {table}_no_delete BEFORE DELETE ON {table}
BEGIN SELECT RAISE(ABORT, '{APPEND_ONLY} (DELETE refused)'); END""",
    )


POSTGRES_FUNCTION = f"""CREATE FUNCTION cpn_books_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '{APPEND_ONLY} (% refused)', TG_OP USING ERRCODE = 'restrict_violation';
END
$$"""


def _postgres_triggers(table: str) -> tuple[str, ...]:
    return (
        f"""CREATE TRIGGER {table}_no_update_delete BEFORE UPDATE OR DELETE ON {table}
FOR EACH ROW EXECUTE FUNCTION cpn_books_append_only()""",
        f"""CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table}
FOR EACH STATEMENT EXECUTE FUNCTION cpn_books_append_only()""",
    )


def upgrade() -> None:
    op.create_table(
        "providers",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("fee_rate", sa.Numeric(precision=7, scale=6), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("fee_rate >= 0 AND fee_rate < 1", name="ck_provider_fee"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    with op.batch_alter_table("clusters") as batch:
        batch.add_column(sa.Column("provider_id", sa.String(length=36), nullable=True))
        batch.create_foreign_key(
            "fk_clusters_provider", "providers", ["provider_id"], ["id"], ondelete="RESTRICT"
        )
        batch.create_index("ix_clusters_provider_id", ["provider_id"])
    for table in ("gpu_prices", "egress_prices"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("provider_id", sa.String(length=36), nullable=True))
            batch.create_foreign_key(f"fk_{table}_provider", "providers", ["provider_id"], ["id"])
            if table == "gpu_prices":
                batch.add_column(sa.Column("gpus", sa.Integer(), nullable=True))
                batch.add_column(sa.Column("until", sa.DateTime(timezone=True), nullable=True))
                batch.add_column(
                    sa.Column("min_hours", sa.Numeric(precision=10, scale=6), nullable=True)
                )
    op.create_table(
        "bandwidth_prices",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("cluster_id", sa.String(length=36), nullable=False),
        sa.Column("price_per_gbps_hour", sa.Numeric(precision=18, scale=6), nullable=False),
        sa.Column("effective_from", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("provider_id", sa.String(length=36), nullable=True),
        sa.ForeignKeyConstraint(["cluster_id"], ["clusters.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["provider_id"], ["providers.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_bandwidth_price_lookup", "bandwidth_prices", ["cluster_id", "effective_from"]
    )
    op.create_table(
        "slas",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("cluster_id", sa.String(length=36), nullable=False),
        sa.Column("provider_id", sa.String(length=36), nullable=False),
        sa.Column("uptime", sa.Numeric(precision=7, scale=6), nullable=True),
        sa.Column("uplink_gbps", sa.Float(), nullable=True),
        sa.Column("credit_rate", sa.Numeric(precision=7, scale=6), nullable=False),
        sa.Column("effective_from", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("uptime IS NULL OR (uptime > 0 AND uptime <= 1)", name="ck_sla_uptime"),
        sa.CheckConstraint("credit_rate > 0 AND credit_rate <= 1", name="ck_sla_credit"),
        sa.ForeignKeyConstraint(["cluster_id"], ["clusters.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["provider_id"], ["providers.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_sla_lookup", "slas", ["cluster_id", "effective_from"])
    op.create_table(
        "postings",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("ledger_id", sa.Integer(), nullable=False),
        sa.Column("account", sa.String(length=16), nullable=False),
        sa.Column("party_id", sa.String(length=36), nullable=True),
        sa.Column("cluster", sa.String(length=63), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("amount", sa.Numeric(precision=18, scale=6), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "account IN ('tenant', 'provider', 'platform')", name="ck_posting_account"
        ),
        sa.ForeignKeyConstraint(["ledger_id"], ["ledger.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_postings_ledger_id", "postings", ["ledger_id"])
    op.create_index("ix_postings_party", "postings", ["account", "party_id", "id"])
    op.create_table(
        "payouts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("provider_id", sa.String(length=36), nullable=False),
        sa.Column("amount", sa.Numeric(precision=18, scale=6), nullable=False),
        sa.Column("reference", sa.String(length=128), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["provider_id"], ["providers.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_payouts_provider_id", "payouts", ["provider_id"])
    _backfill()
    if op.get_bind().dialect.name == "sqlite":
        for table in TABLES:
            for statement in _sqlite_triggers(table):
                op.execute(statement)
    else:
        op.execute(POSTGRES_FUNCTION)
        for table in TABLES:
            for statement in _postgres_triggers(table):
                op.execute(statement)


def _backfill() -> None:
    """The postings of entries written before providers existed: the tenant pays, the
    platform (the operator) is credited."""
    op.execute(
        """INSERT INTO postings (ledger_id, account, party_id, cluster, kind, amount, at,
                                 created_at)
        SELECT id, 'tenant', tenant_id, 'platform', kind, -amount, period_end, created_at
        FROM ledger"""
    )
    op.execute(
        """INSERT INTO postings (ledger_id, account, party_id, cluster, kind, amount, at,
                                 created_at)
        SELECT id, 'platform', NULL, 'platform', kind, amount, period_end, created_at
        FROM ledger"""
    )


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        for table in TABLES:
            op.execute(f"DROP TRIGGER IF EXISTS {table}_no_update")
            op.execute(f"DROP TRIGGER IF EXISTS {table}_no_delete")
    else:
        for table in TABLES:
            op.execute(f"DROP TRIGGER IF EXISTS {table}_no_truncate ON {table}")
            op.execute(f"DROP TRIGGER IF EXISTS {table}_no_update_delete ON {table}")
        op.execute("DROP FUNCTION IF EXISTS cpn_books_append_only()")
    op.drop_index("ix_bandwidth_price_lookup", table_name="bandwidth_prices")
    op.drop_table("bandwidth_prices")
    op.drop_index("ix_sla_lookup", table_name="slas")
    op.drop_table("slas")
    op.drop_index("ix_payouts_provider_id", table_name="payouts")
    op.drop_table("payouts")
    op.drop_index("ix_postings_party", table_name="postings")
    op.drop_index("ix_postings_ledger_id", table_name="postings")
    op.drop_table("postings")
    for table in ("egress_prices", "gpu_prices"):
        with op.batch_alter_table(table) as batch:
            batch.drop_constraint(f"fk_{table}_provider", type_="foreignkey")
            batch.drop_column("provider_id")
            if table == "gpu_prices":
                batch.drop_column("min_hours")
                batch.drop_column("until")
                batch.drop_column("gpus")
    with op.batch_alter_table("clusters") as batch:
        batch.drop_index("ix_clusters_provider_id")
        batch.drop_constraint("fk_clusters_provider", type_="foreignkey")
        batch.drop_column("provider_id")
    op.drop_table("providers")
