"""The console's routes: sign-in and sign-out, and one page shell per view.

Pages are shells: the server renders the navigation, the forms and their labels; the page's
script (`static/console.js`) fills them from the REST API under `/v1`, with the session
cookie instead of a bearer key. Who may see a page is decided here (an admin page is a 404 to
a tenant, as the API's own admin objects are); what a page shows is scoped by the API.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cache
from html import escape
from importlib import resources
from pathlib import Path
from string import Template
from typing import Annotated

from fastapi import APIRouter, FastAPI, Header, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from sqlalchemy import select

from api.deps import app_state, audit_failure, console_session, current_principal
from api.limits import credential_tag
from api.problems import problem
from api.sessions import CSRF_HEADER, SESSION_COOKIE, ConsoleSession, ConsoleSessions, csrf_ok
from controller.access.keys import Principal, hash_key
from controller.jobs import service as job_service
from controller.store.models import Provider, Tenant, utcnow
from controller.values.errors import NotFound
from grammar.states import STATES

router = APIRouter(prefix="/ui", include_in_schema=False)
STATIC = Path(__file__).parent / "static"
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
READERS = ("tenant", "admin")
"""Who reads the tenants' views (jobs, usage); `SIGNS_IN` adds providers (pages of their own)."""
SIGNS_IN = (*READERS, "provider")
HOME = {"provider": "provider"}
"""Where `/ui` takes a role that is not at home on the jobs page."""


@dataclass(frozen=True)
class Page:
    """One view of the console: its path under /ui, its title, its body template, and the
    key roles that may open it (others get a 404)."""

    path: str
    title: str
    template: str
    roles: tuple[str, ...] = READERS


PAGES = (
    Page("network", "Network", "network"),
    Page("jobs", "Jobs", "jobs"),
    Page("quote", "Quote", "quote", roles=("tenant",)),
    Page("usage", "Usage", "usage"),
    Page("pricing", "Pricing", "pricing", roles=SIGNS_IN),
    Page("provider", "Provider", "provider", roles=("provider", "admin")),
    Page("admin/providers", "Providers", "providers", roles=("admin",)),
    Page("admin/clusters", "Clusters", "clusters", roles=("admin",)),
    Page("admin/tenants", "Tenants", "tenants", roles=("admin",)),
    Page("admin/keys", "API keys", "keys", roles=("admin",)),
    Page("admin/audit", "Audit log", "audit", roles=("admin",)),
)
BY_PATH = {p.path: p for p in PAGES}
JOB_PAGE = Page("jobs", "Job", "job")
LOGIN_PAGE = Page("login", "Sign in", "login", roles=())
NOT_FOUND_PAGE = Page("", "Not found", "notfound")


@cache
def template(name: str) -> Template:
    text = resources.files("api.ui").joinpath(f"templates/{name}.html").read_text("utf-8")
    return Template(text)


def safe_next(target: str | None) -> str:
    """Where to go after signing in: a console path only (never another site)."""
    if target and target.startswith("/ui/") and not target.startswith("//") and "\\" not in target:
        return target
    return "/ui"


def nav(principal: Principal | None, current: str) -> str:
    if principal is None:
        return ""
    links = []
    for page in PAGES:
        if principal.role in page.roles:
            here = ' aria-current="page"' if page.path == current else ""
            links.append(f'<a href="/ui/{page.path}"{here}>{escape(page.title)}</a>')
    return "".join(links)


def render(
    page: Page,
    principal: Principal | None,
    session: ConsoleSession | None,
    status_code: int = 200,
    who_label: str | None = None,
    **values: str,
) -> HTMLResponse:
    """The page's shell: navigation, who is signed in, and the page's own markup."""
    fields = {k: escape(v) for k, v in values.items()}
    body = template(page.template).safe_substitute(
        states="".join(f'<option value="{s}">{s}</option>' for s in STATES), **fields
    )
    who = ""
    if principal is not None:
        label = who_label or principal.role + (f" · {principal.scope}" if principal.scope else "")
        who = (
            f'<div class="who"><span>{escape(label)}</span>'
            '<button type="button" id="sign-out">Sign out</button></div>'
        )
    html = template("shell").substitute(
        title=escape(page.title),
        page=escape(page.template),
        csrf=escape(session.csrf if session else ""),
        role=escape(principal.role if principal else ""),
        tenant=escape(principal.scope or "" if principal else ""),
        job=fields.get("job_id", ""),
        nav=nav(principal, page.path),
        who=who,
        body=body,
    )
    return HTMLResponse(html, status_code=status_code, headers=SECURITY_HEADERS)


async def viewer(request: Request) -> tuple[Principal, ConsoleSession] | None:
    """The signed-in caller of a page, if its session and its key are both still live."""
    session = await console_session(request)
    if session is None:
        return None
    principal = await current_principal(request, session.key_hash)
    if principal is None or principal.role not in SIGNS_IN:
        return None
    return principal, session


def to_login(request: Request) -> RedirectResponse:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    response = RedirectResponse(f"/ui/login?next={target}", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


@router.get("")
async def root(request: Request) -> RedirectResponse:
    """The signed-in role's first page: the jobs, or a provider's own page."""
    seen = await viewer(request)
    home = HOME.get(seen[0].role, "jobs") if seen is not None else "jobs"
    return RedirectResponse(f"/ui/{home}", status_code=303)


@router.get("/login")
async def login_page(request: Request, next: str | None = None) -> Response:
    if await viewer(request) is not None:
        return RedirectResponse(safe_next(next), status_code=303)
    return render(LOGIN_PAGE, None, None, next=safe_next(next))


class SignIn(BaseModel):
    key: str = Field(min_length=1, max_length=256, description="An API key: cpn_...")


REFUSALS = {
    401: ("Unauthorized", "unauthorized"),
    403: ("Forbidden", "forbidden"),
    429: ("Too many requests", "rate-limited"),
}


def sign_in_refused(
    request: Request, detail: str, status_code: int = 401, retry_after: str | None = None
) -> Response:
    """A refused sign-in, as a problem naming the key field (the page shows it there); a 429
    says when to retry (`Retry-After`, as every 429 of the API does)."""
    title, slug = REFUSALS[status_code]
    return problem(
        status_code,
        title,
        detail,
        slug=slug,
        instance=request.url.path,
        errors=[{"field": "key", "message": detail}],
        headers={"Retry-After": retry_after} if retry_after is not None else None,
    )


@router.post("/session")
async def sign_in(
    body: SignIn,
    request: Request,
    csrf: Annotated[str | None, Header(alias=CSRF_HEADER)] = None,
) -> Response:
    """Trade an API key for a session cookie. The custom header keeps other sites from signing
    a browser in with their own key (a cross-origin form or fetch cannot send it)."""
    if not csrf:
        return sign_in_refused(request, f"sign in from the console's page (it sends {CSRF_HEADER})")
    state = app_state(request)
    key_hash = hash_key(body.key)
    address = request.client.host if request.client else "unknown"
    refusal = state.rate_limits.admit(
        address=address,
        key_hash=key_hash,
        known_key=state.principals.get(key_hash) is not None,
        agent=False,
        now=time.monotonic(),
        tag=credential_tag(body.key),
    )
    if refusal is not None:
        return sign_in_refused(request, refusal.detail, 429, refusal.retry_after())
    principal = await current_principal(request, key_hash)
    if principal is None:
        state.rate_limits.auth_failed(address, time.monotonic(), credential_tag(body.key))
        await audit_failure(request)
        return sign_in_refused(request, "this API key is unknown, revoked or expired")
    if principal.role not in SIGNS_IN:
        return sign_in_refused(
            request,
            f"the console takes tenant, provider and admin keys, not {principal.role} keys",
            403,
        )
    sessions: ConsoleSessions = state.console_sessions
    sid, _ = await run_in_threadpool(sessions.open, key_hash, utcnow())
    response = Response(status_code=204)
    response.set_cookie(
        SESSION_COOKIE,
        sid,
        max_age=int(sessions.ttl_s),
        path="/",
        httponly=True,
        samesite="strict",
        # behind a TLS-terminating proxy the request reads http: CPN_COOKIE_SECURE forces it
        secure=state.settings.cookie_secure or request.url.scheme == "https",
    )
    return response


@router.post("/session/end")
async def sign_out(
    request: Request, csrf: Annotated[str | None, Header(alias=CSRF_HEADER)] = None
) -> Response:
    """Forget the session (its cookie alone no longer signs anyone in, on any replica)."""
    session = await console_session(request)
    if session is not None and not csrf_ok(session, "POST", csrf):
        return problem(
            403,
            "Forbidden",
            f"signing out needs the {CSRF_HEADER} header of the console's page; reload it",
            slug="forbidden",
            instance=request.url.path,
        )
    sessions: ConsoleSessions = app_state(request).console_sessions
    await run_in_threadpool(sessions.close, request.cookies.get(SESSION_COOKIE))
    response = Response(status_code=204)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


def _who(request: Request, principal: Principal) -> str:
    """Who is signed in, as the header says it: a tenant or provider by its name, not its id."""
    if principal.role not in ("tenant", "provider") or not principal.scope:
        return principal.role
    party = Tenant if principal.role == "tenant" else Provider
    with app_state(request).sessions() as session:
        name = session.scalar(select(party.name).where(party.id == principal.scope))
    return f"{principal.role} · {name or principal.scope}"


def _visible_job(request: Request, job_id: str, scope: str | None) -> bool:
    with app_state(request).sessions() as session:
        try:
            job_service.get_job(session, job_id, scope)
        except NotFound:
            return False
    return True


@router.get("/jobs/{job_id}")
async def job_page(request: Request, job_id: str) -> Response:
    seen = await viewer(request)
    if seen is None:
        return to_login(request)
    principal, session = seen
    scope = None if principal.role == "admin" else principal.scope
    if not await run_in_threadpool(_visible_job, request, job_id, scope):
        return render(
            NOT_FOUND_PAGE, principal, session, 404, what=f"no job {job_id!r} that you can see"
        )
    who = await run_in_threadpool(_who, request, principal)
    return render(JOB_PAGE, principal, session, who_label=who, job_id=job_id)


@router.get("/{path:path}")
async def page(request: Request, path: str) -> Response:
    seen = await viewer(request)
    if seen is None:
        return to_login(request)
    principal, session = seen
    found = BY_PATH.get(path.rstrip("/"))
    if found is None or principal.role not in found.roles:
        return render(NOT_FOUND_PAGE, principal, session, 404, what=f"no page /ui/{path}")
    return render(
        found, principal, session, who_label=await run_in_threadpool(_who, request, principal)
    )


def install(app: FastAPI) -> None:
    """Serve the console at /ui: its sessions, its pages and its static files."""
    app.mount("/ui/static", StaticFiles(directory=STATIC), name="ui-static")
    app.include_router(router)
