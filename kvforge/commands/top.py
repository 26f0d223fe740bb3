"""`kvforge top`: a running server's KV block map in the terminal (pool bar, requests, hit rate, events).

Reads `GET /kv/state` every `--interval` seconds, as the `/kv` page does, and draws it with
curses; `--once` prints one frame and exits (scripts, logs). HTTP only, so it watches a server
on another machine as well.
"""
from __future__ import annotations

import argparse
import sys
import time

HELP = "watch a running server's KV cache: pool, requests, hit rate, events (like top)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address")
    p.add_argument("--api-key", default=None, help="bearer token (default: $KVFORGE_API_KEY)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one frame and exit")


class _Watcher:
    """Polls /kv/state; keeps the events seen so far (the server's log is bounded, the screen shows the newest)."""

    def __init__(self, base_url: str, api_key: str | None) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=10)
        self.events: list[dict] = []
        self.next_event = 0

    def poll(self) -> dict:
        r = self.client.get("/kv/state", params={"since": self.next_event})
        if r.status_code != 200:
            raise RuntimeError(f"GET /kv/state answered HTTP {r.status_code}: {r.text[:200]}")
        snap = r.json()
        self.events = (self.events + snap["events"])[-200:]
        self.next_event = snap["next_event"]
        return snap


def run(args: argparse.Namespace) -> int:
    import httpx

    from kvforge.server.auth import resolve_api_key
    from kvforge.server.kv_top import render_frame

    if not args.interval > 0:
        print(f"kvforge top: --interval must be > 0, got {args.interval}", file=sys.stderr)
        return 2
    watcher = _Watcher(args.base_url, resolve_api_key(args.api_key))
    try:
        snap = watcher.poll()
    except (httpx.HTTPError, RuntimeError) as exc:
        print(f"kvforge top: cannot read {args.base_url}/kv/state: {exc}", file=sys.stderr)
        return 2
    if args.once:
        print("\n".join(render_frame(snap, args.base_url, events=watcher.events)))
        return 0
    import curses

    def loop(screen: "curses.window") -> None:
        nonlocal snap
        curses.curs_set(0)
        screen.timeout(int(args.interval * 1000))
        error = ""
        while True:
            height, width = screen.getmaxyx()
            screen.erase()
            lines = render_frame(snap, args.base_url, width - 1, height - 1, watcher.events)
            if error:
                lines = [f"(last refresh failed: {error})", *lines][: height - 1]
            for y, line in enumerate(lines):
                screen.addnstr(y, 0, line, width - 1)
            screen.refresh()
            if screen.getch() in (ord("q"), ord("Q"), 27):
                return
            try:
                snap, error = watcher.poll(), ""
            except (httpx.HTTPError, RuntimeError) as exc:
                error = str(exc)[:120]
                time.sleep(args.interval)

    try:
        curses.wrapper(loop)
    except KeyboardInterrupt:
        pass
    return 0
