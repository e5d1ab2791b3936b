"""Persistence: the engine, the typed models, migrations, the database's clock, table
statistics and the fault-injection points the crash tests arm."""
