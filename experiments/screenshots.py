"""Screenshots of every dashboard page in headless Chromium, and a check that they are not blank.

``policyd screenshots --api http://127.0.0.1:8470 --out docs/figures/ui`` starts ``streamlit run
ui/app.py`` on a free port, waits for ``/_stcore/health``, and has Debian's ``chromium``, driven
through Playwright, load each page and save ``<out>/<page>.png`` once the page is done: Streamlit
marks its app element ``data-test-script-state="notRunning"`` when the page's script has finished,
and every Vega-Lite chart has drawn its canvas. tests/test_ui_live.py uses the same functions.

Chromium's own ``--screenshot`` cannot wait for that: it captures when a virtual-time budget runs
out, and Chromium 156.0.8078.114 often captured an empty white page that way however long the
budget (docs/UI.md, "Screenshots").
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
from PIL import Image
from playwright.sync_api import Browser, Page, sync_playwright
from playwright.sync_api import Error as PlaywrightError

from experiments.ui_demo import start_live_daemon
from ui.views import PAGES

# the dashboard Streamlit runs, found without importing it (importing it runs the app)
APP: Final = Path(importlib.util.find_spec("ui.app").origin or "ui/app.py")  # type: ignore[union-attr]
WINDOW: Final = (1400, 1800)
PAGE_TIMEOUT_S: Final = 120.0  # a loaded CI machine runs a page's script slowly, not never
STARTUP_TIMEOUT_S: Final = 60.0
CHROMIUM_FLAGS: Final = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
)
# the page's script has run (a run id exists) and is not running now
SCRIPT_DONE: Final = '[data-testid="stApp"][data-test-script-state="notRunning"]'
CHARTS_DRAWN: Final = """() => [...document.querySelectorAll('.vega-embed')]
    .every(chart => chart.querySelector('canvas, svg'))"""
SCRIPT_STATE: Final = """() => {
    const app = document.querySelector('[data-testid="stApp"]');
    return app ? app.getAttribute('data-test-script-state') : 'no app element';
}"""


class ScreenshotError(RuntimeError):
    """Streamlit or Chromium failed to produce a page image."""


def chromium_path() -> str | None:
    """Debian's ``chromium`` (or ``chromium-browser`` / ``google-chrome``) if installed."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def page_paths() -> dict[str, str]:
    """Page name -> URL path; the first page is the app's root."""
    return {
        url_path: "/" if index == 0 else f"/{url_path}"
        for index, (_, _, _, url_path) in enumerate(PAGES)
    }


@contextlib.contextmanager
def streamlit_server(
    api_url: str,
    *,
    token: str | None = None,
    refresh_s: float = 600.0,
    log_path: Path | None = None,
) -> Iterator[str]:
    """``streamlit run ui/app.py`` on a free loopback port; yields its base URL."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.headless=true",
        f"--server.port={port}",
        "--server.address=127.0.0.1",
        "--server.fileWatcherType=none",
        "--browser.gatherUsageStats=false",
        "--client.toolbarMode=minimal",
        "--",
        "--api",
        api_url,
        "--refresh-s",
        str(refresh_s),
    ]
    if token:
        command += ["--token", token]
    log = open(log_path or os.devnull, "wb")  # noqa: SIM115 - closed in finally
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, process)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def wait_healthy(base: str, process: subprocess.Popen[bytes]) -> None:
    """Poll ``/_stcore/health`` until it answers ok, the process dies, or the deadline passes."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ScreenshotError(f"streamlit exited with {process.returncode} before serving")
        try:
            with urllib.request.urlopen(f"{base}/_stcore/health", timeout=2) as response:
                if response.status == 200 and response.read().strip() == b"ok":
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise ScreenshotError(f"streamlit at {base} not healthy within {STARTUP_TIMEOUT_S:g} s")


@contextlib.contextmanager
def chromium_browser() -> Iterator[Browser]:
    """Debian's ``chromium``, headless, driven through Playwright."""
    chromium = chromium_path()
    if chromium is None:
        raise ScreenshotError("chromium is not installed (apt-get install -y chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=list(CHROMIUM_FLAGS))
        try:
            yield browser
        finally:
            browser.close()


def capture_page(page: Page, url: str, out: Path, *, timeout_s: float = PAGE_TIMEOUT_S) -> Path:
    """Load ``url`` in ``page``; save a PNG of the viewport once its script and charts are done."""
    timeout_ms = timeout_s * 1000
    try:
        page.goto(url, wait_until="load", timeout=timeout_ms)
        page.wait_for_selector(SCRIPT_DONE, timeout=timeout_ms)
        page.wait_for_function(CHARTS_DRAWN, timeout=timeout_ms)
    except PlaywrightError as exc:
        try:
            state = page.evaluate(SCRIPT_STATE)
        except PlaywrightError:
            state = "unknown"
        raise ScreenshotError(
            f"{url} not done within {timeout_s:g} s (script state {state!r}): {exc.message}"
        ) from exc
    out.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(out))
    return out


@dataclass(frozen=True)
class Blankness:
    """How much a screenshot shows: pixel spread, share of non-background pixels, colours."""

    std: float
    ink_fraction: float
    colors: int

    def blank(self, *, min_ink: float = 0.02, min_colors: int = 16) -> bool:
        return self.std < 5.0 or self.ink_fraction < min_ink or self.colors < min_colors


def measure(png: Path) -> Blankness:
    """Decode ``png``; the background is its most common colour."""
    pixels = np.asarray(Image.open(png).convert("RGB"), dtype=np.int32).reshape(-1, 3)
    packed = (pixels[:, 0] << 16) | (pixels[:, 1] << 8) | pixels[:, 2]
    values, counts = np.unique(packed, return_counts=True)
    top = int(values[int(np.argmax(counts))])
    background = np.array([(top >> 16) & 255, (top >> 8) & 255, top & 255])
    ink = np.abs(pixels - background).sum(axis=1) > 24
    return Blankness(std=float(pixels.std()), ink_fraction=float(ink.mean()), colors=len(values))


def color_pixels(png: Path, color: str, *, tolerance: int = 40) -> int:
    """Pixels within ``tolerance`` (sum of channel differences) of the hex ``color``: a chart's
    marks drawn in a colour of its own show up here, a missing chart does not."""
    pixels = np.asarray(Image.open(png).convert("RGB"), dtype=np.int32).reshape(-1, 3)
    target = np.array([int(color.lstrip("#")[i : i + 2], 16) for i in (0, 2, 4)])
    return int((np.abs(pixels - target).sum(axis=1) <= tolerance).sum())


def capture_all(
    api_url: str,
    out_dir: Path,
    *,
    token: str | None = None,
    pages: Sequence[str] | None = None,
    attempts: int = 3,
    log_path: Path | None = None,
) -> dict[str, Path]:
    """Screenshot each page (all by default) of a dashboard pointed at ``api_url``; a capture that
    is blank all the same (a page drawn after its script finished) is retaken."""
    paths = page_paths()
    chosen = list(pages) if pages else list(paths)
    shots: dict[str, Path] = {}
    with (
        chromium_browser() as browser,
        streamlit_server(api_url, token=token, log_path=log_path) as base,
    ):
        page = browser.new_page(viewport={"width": WINDOW[0], "height": WINDOW[1]})
        for name in chosen:
            started = time.monotonic()
            tries = 0
            while True:
                tries += 1
                shots[name] = capture_page(page, base + paths[name], out_dir / f"{name}.png")
                if tries >= attempts or not measure(shots[name]).blank():
                    break
            elapsed_s = time.monotonic() - started
            print(f"{name}: {shots[name]} in {elapsed_s:.1f} s, {tries} tries", flush=True)
    return shots


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="policyd screenshots", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--api", default=os.environ.get("POLICYD_API_URL", "http://127.0.0.1:8470"))
    parser.add_argument("--token", default=os.environ.get("POLICYD_API_TOKEN"))
    parser.add_argument("--out", type=Path, default=Path("docs/figures/ui"))
    parser.add_argument("--page", action="append", help="only these pages (repeatable)")
    parser.add_argument(
        "--demo",
        action="store_true",
        help="start a daemon with replay data first (experiments/ui_demo.py), not --api",
    )
    parser.add_argument("--workflows", type=int, default=24, help="--demo: workflows replayed")
    parser.add_argument("--seconds", type=float, default=30.0, help="--demo: replay wall time")
    args = parser.parse_args(argv)
    if args.demo:
        with tempfile.TemporaryDirectory(prefix="agentkv-ui-demo-") as tmp:
            run, _ = start_live_daemon(
                Path(tmp) / "history.duckdb",
                workflows=args.workflows,
                seconds=args.seconds,
                progress=print,
            )
            try:
                assert run.http_url is not None
                shots = capture_all(run.http_url, args.out, pages=args.page)
            finally:
                run.stop()
    else:
        shots = capture_all(args.api, args.out, token=args.token, pages=args.page)
    measured = {name: measure(path) for name, path in shots.items()}
    blank = [name for name, m in measured.items() if m.blank()]
    for name, m in measured.items():
        print(f"{name}: {m}")
    if blank:
        print(f"blank pages: {', '.join(blank)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
