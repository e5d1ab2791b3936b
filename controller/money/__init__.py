"""Money: the effective-dated price catalogue, metering into the ledger, and budgets."""
