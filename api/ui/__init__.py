"""The web console at `/ui`: server-rendered page shells whose one script calls the REST API.

Its sign-ins are authentication, not UI: they live in `api.sessions`, beside `api.deps`."""
