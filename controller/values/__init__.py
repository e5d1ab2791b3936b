"""Typed values the other wings pass around: the job spec, its states, its plan, its task's
cost, and the errors the API turns into problems. Pure: no database, no I/O."""
