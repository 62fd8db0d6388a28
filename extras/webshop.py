"""extras/webshop.py: the WebShop environment over HTTP (docs/ALGORITHM.md "Environments"). Talks
with `requests` to WebShop's own Flask server (princeton-nlp/WebShop, web_agent_site/app.py, port
3000), the way the ReAct WebShop experiments did, and gives it the ALFWorld env API of envs.py
(train.py's make_pool imports this module for --env webshop; envs.EnvPool's workers import it by
name): `tasks`, `reset(task) -> (obs, info)`, `step(text) -> (obs, reward, done, info)`, `close()`.
Imports envs (the reward, the validity convention, TaskError); envs never imports this module.

What mirrors the real app: the five routes and their argument formats (URL building below), the
page structure the parser relies on (ids `instruction-text`, `search_input`, `reward`; `<button>`s,
`a.product-link`, radio `<input>`s with `<label>`s), the button labels, the fixed sessions
`fixed_<goal index>`, and the score on the done page. What is ours: the observation and state key
formats, invalid-step handling and the retry policy. The real pages keep no navigation state on the
server (everything is in the URL), so the K parallel rollouts of one goal can share its session.
"""

import json
import random
import re
import time
from html.parser import HTMLParser
from urllib.parse import quote

import requests

from envs import SUCCESS_REWARD, TaskError, normalize_action

NUM_GOALS = 12087  # WebShop's human instructions (paper: 10,587 train + 1,000 dev + 500 test)
TEST_GOALS = 500  # goals 0-499: the standard test set; 500+: training (verl-agent, GiGPO)
SUB_PAGES = ("Description", "Features", "Reviews", "Attributes")  # engine.ACTION_TO_TEMPLATE
START_HINT = (
    "start it in a WebShop checkout with ./run_dev.sh (or python -m web_agent_site.app "
    "--log --attrs), or point --webshop-url at a running one"
)


# The real app's routes (app.py) and their arguments after the session, in URL order.
ROUTES = {
    "index": (),
    "search_results": ("keywords", "page"),
    "item_page": ("asin", "keywords", "page", "options"),
    "item_sub_page": ("asin", "keywords", "page", "sub_page", "options"),
    "done": ("asin", "options"),
}


def _at(route, current, **changes):
    """The page `route` reached from page `current`: its arguments carried over, some changed."""
    return {"route": route, **{k: changes.get(k, current.get(k)) for k in ROUTES[route]}}


def _arg(value, sort_keys=False):
    """A route argument as text. Keywords go as plain text: app.py's convert_web_app_string_to_var
    wraps a string that is not a list literal in a list. Options go as a JSON dict, which is also
    the Python literal app.py reads with `literal_eval`."""
    return json.dumps(value, sort_keys=sort_keys) if isinstance(value, dict) else str(value)


class WebShopUnreachable(requests.exceptions.ConnectionError, ConnectionError):
    """No answer from the server after the bounded retries. Subclasses both requests' and the
    builtin ConnectionError, so either family of `except` clause catches it."""


# ---------------------------------------------------------------------------------------------
# Page parsing with the standard library. One pass collects the visible text chunks in order
# (the text env's `tag_visible` rule, plus hidden/display:none subtrees, which hold the done
# page's goal details), which of them are clickable, the radio options, the search box, the
# instruction and the score. The real templates close tags they never opened (`<h4>..</h5>`), so
# an end tag pops the stack down to its opener and a stray one is ignored.
# ---------------------------------------------------------------------------------------------

_VOID = {
    "area",
    "base",
    "br",
    "col",
    "embed",
    "hr",
    "img",
    "input",
    "link",
    "meta",
    "source",
    "track",
    "wbr",
}
_INVISIBLE = {"script", "style", "head", "title", "template", "noscript"}
_ACTION_RE = re.compile(r"\s*(search|click)\s*\[(.*)\]\s*", re.DOTALL | re.IGNORECASE)
_SCORE_RE = re.compile(
    r"score\s*(?:\([^)]*\))?\s*:?\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)", re.IGNORECASE
)


class _Page(HTMLParser):
    def __init__(self, html):
        super().__init__(convert_charrefs=True)
        self.chunks = []  # [(text, kind)], kind: "text" | "button" | "product" | "label"
        self.radios = {}  # option value -> option name (the radio group)
        self.has_search = False
        self.instruction, self.reward_text = [], []
        self._stack = []  # [(tag, attrs, hidden)]
        self._query_seen = False
        self.feed(html)
        self.close()

    def handle_starttag(self, tag, attrs):
        a = {k: (v or "") for k, v in attrs}
        if tag == "input" and a.get("type", "").lower() == "radio" and a.get("value"):
            self.radios[a["value"]] = a.get("name", "")
        if tag == "input" and (a.get("id") == "search_input" or a.get("name") == "search_query"):
            self.has_search = True
        if tag in _VOID:
            return
        hidden = (
            (self._stack and self._stack[-1][2])
            or "hidden" in a
            or "display:none" in a.get("style", "").replace(" ", "").lower()
        )
        self._stack.append((tag, a, bool(hidden)))

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in _VOID and self._stack:  # `<div/>` opens nothing
            self._stack.pop()

    def handle_endtag(self, tag):
        tags = [t for t, _, _ in self._stack]
        if tag in tags:
            del self._stack[len(tags) - 1 - tags[::-1].index(tag) :]

    def handle_data(self, data):
        text = " ".join(data.split())
        if not text or any(t in _INVISIBLE for t, _, _ in self._stack):
            return
        ids = {a.get("id") for _, a, _ in self._stack}
        if "reward" in ids:
            self.reward_text.append(text)
        if self._stack and self._stack[-1][2]:
            return
        if "instruction-text" in ids:  # "Instruction: <goal>", then "Current Query: ..."
            self._query_seen = self._query_seen or text.startswith("Current Query")
            if not self._query_seen:
                self.instruction.append(text)
        kind = "text"
        for tag, a, _ in reversed(self._stack):  # the innermost clickable element decides
            if tag == "button":
                kind = "button"
            elif tag == "a" and (
                "product-link" in a.get("class", "").split() or "item_page/" in a.get("href", "")
            ):
                kind = "product"
            elif tag == "label":
                kind = "label"
            else:
                continue
            break
        self.chunks.append((text, kind))

    def goal(self):
        text = " ".join(self.instruction).strip()
        return text[len("Instruction:") :].strip() if text.startswith("Instruction:") else text

    def score(self):
        """The done page's score (0-1), or None when the page shows none."""
        source = " ".join(self.reward_text) or " ".join(t for t, _ in self.chunks)
        found = _SCORE_RE.search(source)
        return float(found.group(1)) if found else None


# ---------------------------------------------------------------------------------------------
# The environment.
# ---------------------------------------------------------------------------------------------


class WebShopEnv:
    """One WebShop episode at a time against a running server. Constructing it does no I/O (the
    env pool builds one per worker process from kwargs); the first request is made by `reset`.

    `split`: "train" = goals TEST_GOALS..num_goals-1, "test" = goals 0..TEST_GOALS-1.
    `num_goals`: how many fixed goals the server has; the real app has no route that lists them, so
    it is given: 12087 for the full human-instruction set; lower it for a server built from a
    smaller goal file. WebShop's data lives with its server, and its state key is always the page
    identity.
    `timeout` (read) / `connect_timeout` are seconds; a refused or timed-out request is retried
    `retries` times after `backoff * 2**attempt` seconds, then raises WebShopUnreachable. `seed`
    only drives reset(None), which draws a goal of `tasks`.
    """

    def __init__(
        self,
        url="http://127.0.0.1:3000",
        split="train",
        max_steps=15,
        seed=0,
        num_goals=NUM_GOALS,
        timeout=30.0,
        connect_timeout=3.0,
        retries=2,
        backoff=0.25,
    ):
        if split == "train":
            indices = range(TEST_GOALS, num_goals)
        elif split == "test":
            indices = range(min(TEST_GOALS, num_goals))
        else:
            raise ValueError(f"WebShop split must be 'train' or 'test', got {split!r}")
        if not indices:
            raise ValueError(
                f"num_goals={num_goals} leaves no {split} goals (train uses goals {TEST_GOALS}+)"
            )
        if not url.startswith(("http://", "https://")):
            raise ValueError(
                f"WebShop url must start with http:// or https://, got {url!r} "
                f"(the real server: http://127.0.0.1:3000)"
            )
        self.url, self.split, self.max_steps = url.rstrip("/"), split, max_steps
        self.num_goals = num_goals
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.retries, self.backoff = retries, backoff
        self.tasks = [f"webshop/{i}" for i in indices]
        self._rng = random.Random(seed)
        self._http = requests.Session()
        self._page = None  # the current page: {"route": ..., **its ROUTES arguments}
        self._obs, self._clickables, self._has_search = "", {}, False
        self._steps, self._done, self.goal = 0, True, ""

    # -- HTTP ------------------------------------------------------------------------------------
    def _get(self, path):
        """GET with bounded retry and exponential back-off on refused connections, timeouts and
        502/503/504. Other HTTP errors are returned: they are the page's problem, not the link's."""
        url = self.url + path
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                resp = self._http.get(url, timeout=(self.connect_timeout, self.timeout))
            except (
                requests.ConnectionError,
                requests.Timeout,
                requests.exceptions.ChunkedEncodingError,
            ) as err:
                failure = f"{type(err).__name__}: {err}"
                slow = isinstance(err, requests.ReadTimeout)
                continue
            if resp.status_code not in (502, 503, 504):
                return resp
            failure = f"HTTP {resp.status_code}"
        if failure.startswith("HTTP"):
            return resp
        fix = (
            f"the real app loads its products on its first request (minutes for the full set): "
            f"call webshop.warm_up(url) once first, or raise timeout={self.timeout}"
            if slow
            else START_HINT
        )
        raise WebShopUnreachable(
            f"no WebShop server answers at {self.url} ({self.retries + 1} tries, "
            f"last: {failure.split(':')[0]}): {fix}"
        )

    def _path(self, page):
        """The real app's URL of a page: /<route>/<session>/<args in ROUTES order>, or /<session>
        for the index. See _arg for how keywords and options are written."""
        args = [quote(_arg(page[k]), safe="") for k in ROUTES[page["route"]]]
        if page["route"] == "index":
            return f"/{self._session}"
        return "/".join(["", page["route"], self._session] + args)

    # -- page -> observation, clickables, state --------------------------------------------------
    def _targets(self, parsed, page):
        """normalized label -> (the page a click leads to, whether it is a selected option), for
        what this page shows and the real app's templates define."""
        norm, out, route = normalize_action, {}, page["route"]
        options = page.get("options", {})
        chosen = {norm(v) for v in options.values()}
        radios = {norm(value): (name, value) for value, name in parsed.radios.items()}
        sub_pages = {p.lower(): p for p in SUB_PAGES}
        for text, kind in parsed.chunks:
            label, nxt = norm(text), None
            if kind == "product":
                nxt = _at("item_page", page, asin=text, options={})
            elif kind == "label" and label in radios and route == "item_page":
                name, value = radios[label]
                nxt = _at("item_page", page, options={**options, name: value})
            elif kind != "button" or (label == "search" and parsed.has_search):
                continue
            elif label == "back to search":
                nxt = _at("index", page)
            elif label == "next >" and route == "search_results":
                nxt = _at(route, page, page=page["page"] + 1)
            elif label in ("< prev", "< back to results", "< back to item page"):
                # one label set for "go back one level", as the text env treats "< Prev"
                nxt = {
                    "search_results": _at(route, page, page=max(1, page["page"] - 1)),
                    "item_page": _at("search_results", page),
                    "item_sub_page": _at("item_page", page),
                }.get(route)
            elif label in sub_pages and route == "item_page":
                nxt = _at("item_sub_page", page, sub_page=sub_pages[label])
            elif label == "buy now" and route == "item_page":
                nxt = _at("done", page)
            if nxt is not None:
                out[label] = (nxt, kind == "label" and label in chosen)
        for label, (name, value) in radios.items():  # a radio with no <label>: still clickable
            if route == "item_page" and label not in out:
                nxt = _at("item_page", page, options={**options, name: value})
                out[label] = (nxt, label in chosen)
        return out

    def _load(self, page):
        """GET and parse a page: ((parsed, clickables), None), or (None, why it is unusable): an
        HTTP error, markup html.parser rejects, a done page with no score, or a page with nothing
        to click and no search box (no way on from it)."""
        resp = self._get(self._path(page))
        if resp.status_code != 200:
            return None, f"the server answered HTTP {resp.status_code} for {resp.url}"
        try:
            parsed = _Page(resp.text)
        except AssertionError as err:  # html.parser's way to reject some malformed markup
            return None, f"unparsable page at {resp.url} ({err})"
        clickables = self._targets(parsed, page)
        if page["route"] == "done" and parsed.score() is None:
            return None, f"the done page shows no score ({resp.url})"
        if page["route"] != "done" and not clickables and not parsed.has_search:
            return None, f"nothing to click and no search box at {resp.url} (not a WebShop page?)"
        return (parsed, clickables), None

    def _enter(self, page, parsed, clickables):
        self._page, self._clickables, self._has_search = page, clickables, parsed.has_search
        self._obs = self._render(parsed)

    def _render(self, parsed):
        """Text-env convention: visible texts joined by [SEP], clickables as [button] x [button_],
        the selected options as [clicked button] x [clicked button_]."""
        parts = []
        for text, kind in parsed.chunks:
            target = self._clickables.get(normalize_action(text)) if kind != "text" else None
            if target is None:
                parts.append(text)
            elif target[1]:
                parts.append(f"[clicked button] {text} [clicked button_]")
            else:
                parts.append(f"[button] {text} [button_]")
        return " [SEP] ".join(parts)

    @staticmethod
    def state_key(page):
        """The page identity: its route and arguments as in its URL, without the session (options
        as sorted JSON). The selected options are among the arguments of the item pages."""
        args = [_arg(page[k], sort_keys=True) for k in ROUTES[page["route"]]]
        return "/".join([page["route"]] + args)

    def _admissible(self):
        search = ["search[<query>]"] if self._has_search else []
        return search + [f"click[{label}]" for label in self._clickables]

    def _info(self, **extra):
        return {
            "admissible": self._admissible(),
            "state": self.state_key(self._page),
            "task_type": "webshop",
            "goal": self.goal,
            "won": False,
            "valid": True,
            **extra,
        }

    # -- the env API -----------------------------------------------------------------------------
    def reset(self, task=None):
        """Start goal `task` ("webshop/<index>", or an int; None draws one of `tasks` with the
        seed) on its fixed session and return the search page."""
        task = self._rng.choice(self.tasks) if task is None else task
        prefix, _, index = str(task).rpartition("/")
        if prefix not in ("", "webshop") or not index.isdigit() or int(index) >= self.num_goals:
            raise TaskError(
                f"unknown WebShop task {task!r}: use 'webshop/<goal index>', "
                f"index in 0..{self.num_goals - 1} (num_goals), e.g. env.tasks"
            )
        self._session, self._done = f"fixed_{int(index)}", True
        page = {"route": "index"}
        loaded, error = self._load(page)
        if error is not None:  # app.py answers 500 (IndexError) for a goal past its list
            hint = (
                f"a goal past the server's goal list? then lower num_goals={self.num_goals}"
                if "HTTP 500" in error
                else f"is it a WebShop server? To run one: {START_HINT}"
            )
            raise RuntimeError(f"cannot start WebShop goal {index} at {self.url}: {error} ({hint})")
        self._enter(page, *loaded)
        self.goal, self._steps, self._done = loaded[0].goal(), 0, False
        return self._obs, self._info(task=f"webshop/{int(index)}")

    def step(self, text):
        """One action, `search[query]` or `click[label]`. Anything else, a click on a label this
        page does not show, or a page that fails to load or parse, is an invalid step: the page
        stays as it was and info["error"] says why. Buying ends the episode with reward
        10 x score (the done page's 0-1 score); max_steps ends it with reward 0."""
        if self._done:
            raise RuntimeError("WebShop episode is over: call reset(task) before step()")
        self._steps += 1
        nxt, error = None, None
        match = _ACTION_RE.fullmatch(str(text))
        if match is None:
            error = f"not an action: {text!r}; use search[query] or click[label]"
        elif match.group(1).lower() == "search":
            # lowercased as app.py does; a '/' would split the route once the server decodes %2F
            query = " ".join(match.group(2).replace("/", " ").lower().split())
            if not self._has_search:
                error = "no search box on this page: click[back to search] first"
            elif not query or query == "<query>":
                error = "empty search: write the query inside search[...]"
            else:
                nxt = {"route": "search_results", "keywords": query, "page": 1}
        else:
            target = self._clickables.get(normalize_action(match.group(2)))
            if target is None:
                error = f"nothing to click called {match.group(2)!r} on this page" + (
                    "; to search, write search[your query]" if self._has_search else ""
                )
            else:
                nxt = target[0]
        reward, done, extra = 0.0, False, {}
        if nxt is not None:
            loaded, error = self._load(nxt)
            if error is None:
                self._enter(nxt, *loaded)
                if nxt["route"] == "done":
                    score = loaded[0].score()
                    reward, done = SUCCESS_REWARD * score, True
                    extra = {"score": score, "won": score >= 1.0}
        if error is not None:
            extra = {"valid": False, "error": error}
        if not done and self._steps >= self.max_steps:
            done, extra["truncated"] = True, True
        self._done = done
        return self._obs, reward, done, self._info(**extra)

    def close(self):
        self._http.close()


def warm_up(url, timeout=900.0):
    """Open goal 0 once with a long read timeout and return its instruction. The real app loads
    its products and search index inside its first request (minutes for the full 1.18M products),
    and B x K workers arriving together would each start that load; call this once before the env
    pool. With no server listening it raises WebShopUnreachable within a second or two."""
    env = WebShopEnv(url=url, split="test", num_goals=TEST_GOALS, timeout=timeout)
    try:
        return env.reset("webshop/0")[1]["goal"]
    finally:
        env.close()
