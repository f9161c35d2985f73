"""Driving the console in Chromium: launch flags, signing in through the form, and a tab that
records what a user's browser would notice (dialogs, requests to other hosts, errors such as
Content-Security-Policy violations)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from playwright.sync_api import ConsoleMessage, Dialog, Page, Request, Response, ViewportSize

NO_NETWORK_FLAGS = [
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-features=Translate,OptimizationHints,MediaRouter",
    "--metrics-recording-only",
    "--safebrowsing-disable-auto-update",
]
"""Chromium flags for a machine without network: nothing is fetched in the background."""

DESKTOP: ViewportSize = {"width": 1280, "height": 900}
TABLET: ViewportSize = {"width": 768, "height": 1024}


def launch_args() -> list[str]:
    """:data:`NO_NETWORK_FLAGS`, and ``--no-sandbox`` when running as root (Chromium refuses
    to start its sandbox as root, as in CI containers)."""
    return [*NO_NETWORK_FLAGS, *(["--no-sandbox"] if os.geteuid() == 0 else [])]


def sign_in(page: Page, base: str, username: str, password: str) -> None:
    """Sign in through the login form (the one the page shows, else ``/ui/login``); fails when
    the console does not let the user in."""
    if "/ui/login" not in page.url:
        page.goto(base + "/ui/login")
    page.fill("#username", username)
    page.fill("#password", password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(r"/ui/(?!login)"))


@dataclass
class Tab:
    """A page of the console at ``base``, and what its browser saw happen.

    Every dialog is accepted (``data-confirm`` forms ask with ``window.confirm``) and recorded
    as ``"type: message"``.
    """

    page: Page
    base: str
    dialogs: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    responses: list[Response] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.page.on("dialog", self._dialog)
        self.page.on("request", self._request)
        self.page.on("response", lambda response: self.responses.append(response))
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda error: self.errors.append(f"page error: {error}"))

    def _dialog(self, dialog: Dialog) -> None:
        self.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.accept()

    def _request(self, request: Request) -> None:
        parts = urlsplit(request.url)
        if parts.scheme in ("data", "blob", "about"):
            return
        if parts.netloc != urlsplit(self.base).netloc:
            self.foreign.append(request.url)

    def _console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    # -------------------------------------------------------------- navigation
    def open(self, path: str) -> Response:
        """Go to ``path``; fail unless it answers 200 and is not the login form."""
        response = self.page.goto(self.base + path)
        assert response is not None, path
        assert response.status == 200, f"GET {path}: {response.status}\n{self.text()[:2000]}"
        assert "/ui/login" not in self.page.url or path.startswith("/ui/login"), self.page.url
        return response

    def text(self) -> str:
        return self.page.inner_text("body")

    def alerts(self) -> list[str]:
        """The dialogs that were not a ``data-confirm`` question."""
        return [d for d in self.dialogs if not d.startswith("confirm:")]

    def csp_violations(self) -> list[str]:
        return [e for e in self.errors if "Content Security Policy" in e]

    def wait_for(self, predicate: str, what: str, timeout_ms: float, arg: object = None) -> None:
        """Wait until the JavaScript function ``predicate`` (called with ``arg``) is true in
        the page; fail naming ``what``, with the page's text."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        try:
            self.page.wait_for_function(predicate, arg=arg, timeout=timeout_ms)
        except PlaywrightTimeout:
            raise AssertionError(
                f"timed out after {timeout_ms / 1000:.0f} s waiting for {what} on "
                f"{self.page.url}; the page shows:\n{self.text()[:3000]}\nerrors: {self.errors}"
            ) from None

    def csrf(self) -> str:
        token = self.page.get_attribute('meta[name="csrf-token"]', "content")
        assert token, f"no CSRF token on {self.page.url}"
        return token

    def screenshot(self, folder: Path, name: str) -> Path:
        """A full-page screenshot of the current page as ``folder/name.png``."""
        path = folder / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    @contextmanager
    def viewport(self, size: ViewportSize) -> Iterator[None]:
        """The page at ``size`` for the block, then at its size before."""
        before = self.page.viewport_size
        self.page.set_viewport_size(size)
        try:
            yield
        finally:
            if before is not None:
                self.page.set_viewport_size(before)

    def overflow_px(self) -> int:
        """How far the page is wider than the window (> 0: it scrolls sideways)."""
        wider: int = self.page.evaluate(
            "() => document.documentElement.scrollWidth - window.innerWidth"
        )
        return wider
