"""The web console at `/ui`: server-rendered page shells whose one script calls the REST API.

Importing this package imports nothing else: `api.deps` reads the console's sessions from
`api.ui.sessions`, and `api.ui.routes` imports `api.deps`."""
