"""tests/webshop_server.py: a small WebShop-shaped server for the tests, standard library only.
It serves the routes of princeton-nlp/WebShop's Flask app (web_agent_site/app.py) with pages of the
same structure as its templates (search_page, results_page, item_page, description/features/
review/attributes pages, done_page), over a handful of products, fixed goals `fixed_<i>`, and a
done page whose score follows the shape of engine/goal.py's get_reward (attributes, options, price,
scaled by a type match). Written for these tests; the markup was rewritten from the templates.

Fault injection for the tests: the item pages of B0BROKEN01, B0GARBLED1 and B0BLANK001 are an
HTTP 500, markup that html.parser rejects, and a page with nothing to click (BROKEN_ITEM_PAGES);
buying B0NOSCORE1 shows a done page without a score; `fail_next = n` answers the next n requests
with 503; `delay = s` answers every request s seconds late.
By hand: `python tests/webshop_server.py --port 3000`, then point webshop.WebShopEnv at it.
"""

import argparse
import ast
import html
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

PRODUCTS = [
    {
        "asin": "B000SHOE01",
        "title": "Men's trail running shoes, breathable mesh",
        "price": 39.99,
        "category": "shoes",
        "options": {"color": ["black", "blue"], "size": ["9", "10", "11"]},
        "attributes": ["breathable", "lightweight"],
        "description": "A light trail runner.",
        "features": ["Mesh upper", "Rubber sole"],
        "reviews": ["Great fit.", "Runs small."],
    },
    {
        "asin": "B000SHOE02",
        "title": "Women's leather ankle boots",
        "price": 79.0,
        "category": "shoes",
        "options": {"color": ["brown", "black"], "size": ["7", "8"]},
        "attributes": ["leather", "waterproof"],
        "description": "Classic boots.",
        "features": ["Full-grain leather"],
        "reviews": ["Warm and dry."],
    },
    {
        "asin": "B000MUG001",
        "title": "Ceramic coffee mug, 12 oz",
        "price": 12.5,
        "category": "kitchen",
        "options": {"color": ["white", "red"]},
        "attributes": ["dishwasher safe"],
        "description": "",
        "features": ["12 oz"],
        "reviews": [],
    },
    {
        "asin": "B000TEA001",
        "title": "Green tea bags, organic, 100 count",
        "price": 8.0,
        "category": "grocery",
        "options": {},
        "attributes": ["organic"],
        "description": "Organic green tea.",
        "features": ["100 bags"],
        "reviews": ["Fresh."],
    },
    {
        "asin": "B000SOCK01",
        "title": "Running socks, 6 pairs",
        "price": 15.0,
        "category": "clothing",
        "options": {"size": ["m", "l"]},
        "attributes": ["cotton"],
        "description": "Cushioned socks.",
        "features": ["6 pairs"],
        "reviews": [],
    },
    {
        "asin": "B0BROKEN01",
        "title": "Broken widget",
        "price": 1.0,
        "category": "widgets",
        "options": {},
        "attributes": [],
        "description": "",
        "features": [],
        "reviews": [],
    },
    {
        "asin": "B0NOSCORE1",
        "title": "Mystery widget",
        "price": 2.0,
        "category": "widgets",
        "options": {},
        "attributes": [],
        "description": "",
        "features": [],
        "reviews": [],
    },
    {
        "asin": "B0GARBLED1",
        "title": "Garbled widget",
        "price": 3.0,
        "category": "widgets",
        "options": {},
        "attributes": [],
        "description": "",
        "features": [],
        "reviews": [],
    },
    {
        "asin": "B0BLANK001",
        "title": "Blank widget",
        "price": 4.0,
        "category": "widgets",
        "options": {},
        "attributes": [],
        "description": "",
        "features": [],
        "reviews": [],
    },
]
BROKEN_ITEM_PAGES = {  # asin -> (status, body) of its item page
    "B0BROKEN01": (500, "Internal Server Error"),
    "B0GARBLED1": (200, "<![bogus[ markup that html.parser rejects"),
    "B0BLANK001": (200, "<html><body><p>Oops.</p></body></html>"),  # nothing to click
}
BY_ASIN = {p["asin"]: p for p in PRODUCTS}


def make_goal(index):
    """Goal `index`: one of the first five products with a deterministic choice of options."""
    product = PRODUCTS[index % 5]
    options = {name: values[index % len(values)] for name, values in product["options"].items()}
    wanted = ", ".join(f"{k} {v}" for k, v in options.items())
    return {
        "asin": product["asin"],
        "attributes": product["attributes"],
        "goal_options": options,
        "price_upper": 100.0,
        "category": product["category"],
        "instruction_text": f"i need {product['title'].lower()}"
        f"{', ' + wanted if wanted else ''}, and price lower than 100.00 dollars",
    }


def score(product, goal, options):
    """engine/goal.py's get_reward in shape: (attribute matches + option matches + price ok) /
    (attributes + options + 1), times a type match (here: same category, else 0)."""
    hits = sum(a in product["attributes"] for a in goal["attributes"])
    hits += sum(v in options.values() for v in goal["goal_options"].values())
    hits += product["price"] <= goal["price_upper"]
    total = hits / (len(goal["attributes"]) + len(goal["goal_options"]) + 1)
    return total if product["category"] == goal["category"] else 0.0


def url(*parts):
    """Flask's url_for in shape: each argument str()-ed and percent-quoted."""
    return "/" + "/".join(quote(str(p), safe="") for p in parts)


def page(body, head_title="WebShop"):
    return (
        f'<!DOCTYPE html>\n<html>\n  <head>\n    <link rel="stylesheet" href="/static/style.css">'
        f"\n    <title>{head_title}</title>\n  </head>\n  <body>\n{body}\n  </body>\n"
        "  <script>$(document).ready(function() { /* option radios reload the page */ });"
        "</script>\n</html>"
    )


def form_button(action, label, cls="btn btn-primary"):
    return (
        f'<form method="post" action="{action}"><button type="submit" class="{cls}">'
        f"{html.escape(label)}</button></form>"
    )


def header(goal, keywords):
    return (
        f'<div id="instruction-text"><h4>Instruction: {html.escape(goal["instruction_text"])}'
        f"</h4><h4>Current Query: {html.escape(keywords)}</h4></div>"
    )


class Shop:
    """Server state: the sessions (session id -> goal), exactly what app.py keeps."""

    def __init__(self, num_goals=520, page_size=10):
        self.goals = [make_goal(i) for i in range(num_goals)]
        self.page_size = page_size  # app.py's PRODUCT_WINDOW is 10
        self.sessions, self.requests, self.fail_next, self.delay = {}, [], 0, 0.0

    def handle(self, method, path, form):
        """(status, html, location or None) for one request."""
        self.requests.append((method, path))
        time.sleep(self.delay)
        if self.fail_next > 0:
            self.fail_next -= 1
            return 503, "busy", None
        parts = [unquote(p) for p in urlsplit(path).path.split("/")[1:]]
        route, args = (parts[0], parts[1:]) if len(parts) > 1 else ("index", parts)
        try:
            if route == "index" and len(args) == 1:
                return self.index(args[0], form)
            if route == "search_results" and len(args) == 3:
                return 200, self.results(*args), None
            if route == "item_page" and len(args) == 5:
                return self.item(*args)
            if route == "item_sub_page" and len(args) == 6:
                return 200, self.sub_page(*args), None
            if route == "done" and len(args) == 3:
                return 200, self.done(*args), None
        except (KeyError, IndexError, ValueError, SyntaxError) as err:  # Flask answers 500 too
            return 500, f"Internal Server Error: {err!r}", None
        return 404, "Not Found", None

    def index(self, session, form):
        if session not in self.sessions:
            # app.py: a 'fixed' session takes goal int(session.split('_')[-1]); others get goal 0
            # here
            self.sessions[session] = self.goals[
                int(session.split("_")[-1]) if "fixed" in session else 0
            ]
        if "search_query" in form:  # the search form posts here and is redirected
            return (
                302,
                "",
                url("search_results", session, form["search_query"].lower().split(" "), 1),
            )
        goal = self.sessions[session]
        return (
            200,
            page(
                '<div id="logo"><h2>WebShop</h2></div><div id="instruction-text" '
                'class="text-center">'
                f"<h4>Instruction: <br>{html.escape(goal['instruction_text'])}</h4></div>"
                f'<form role="form" id="form-buscar" method="post" action="{url(session)}">'
                '<input id="search_input" class="form-control" type="text" name="search_query" '
                'placeholder="Search..." required/><button class="btn btn-success" type="submit">'
                '<i class="glyphicon glyphicon-search"></i>Search</button></form>'
            ),
            None,
        )

    def results(self, session, keywords, page_num):
        goal, page_num = self.sessions[session], int(page_num)
        words = ast.literal_eval(keywords) if keywords.startswith("[") else [keywords]
        words = " ".join(words).lower().split()
        ranked = sorted(
            (-sum(w in (p["title"] + " " + p["category"]).lower() for w in words), i)
            for i, p in enumerate(PRODUCTS)
        )
        hits = [PRODUCTS[i] for neg, i in ranked if neg < 0]
        shown = hits[(page_num - 1) * self.page_size : page_num * self.page_size]
        nav = form_button(url(session), "Back to Search", "btn btn-success")
        if page_num > 1:
            nav += form_button(url("search_results", session, keywords, page_num - 1), "< Prev")
        if page_num * self.page_size < len(hits):
            nav += form_button(url("search_results", session, keywords, page_num + 1), "Next >")
        grid = "".join(
            f'<div class="grid-item"><img src="/img/{p["asin"]}.jpg" class="result-img">'
            f'<h4 class="product-asin"><a class="product-link" '
            f'href="{url("item_page", session, p["asin"], keywords, page_num, {})}">'
            f"{p['asin']}</a></h4>"
            f'<h4 class="product-title">{html.escape(p["title"])}</h5>'  # sic, as the template
            f'<div><h5 class="product-price">${p["price"]}</h6></div></div>'
            for p in shown
        )
        return page(
            f'<div class="container py-5">{header(goal, keywords)}<div><h1>Results</h1>'
            f"<p>Page {page_num} ({(page_num - 1) * 10 + 1}-{page_num * 10}) of {len(hits)} "
            f'total results</p></div><div class="inline-block">{nav}</div>'
            f'<div class="grid-container">{grid}</div></div>'
        )

    def item(self, session, asin, keywords, page_num, options):
        goal, product, options = self.sessions[session], BY_ASIN[asin], ast.literal_eval(options)
        if asin in BROKEN_ITEM_PAGES:
            return (*BROKEN_ITEM_PAGES[asin], None)
        radios = ""
        for name, values in product["options"].items():
            radios += f'<div><h4>{html.escape(name)}</h4><div class="radio-toolbar">'
            for k, value in enumerate(values):
                target = url(
                    "item_page", session, asin, keywords, page_num, {**options, name: value}
                )
                checked = " checked" if options.get(name) == value else ""
                radios += (
                    f'<input type="radio" id="radio_{name}{k}" name="{html.escape(name)}" '
                    f'value="{html.escape(value)}" data-url="{target}"{checked}>'
                    f'<label for="radio_{name}{k}">{html.escape(value)}</label>'
                )
            radios += "</div></div>"
        subs = "".join(
            form_button(url("item_sub_page", session, asin, keywords, page_num, s, options), s)
            for s in ("Description", "Features", "Reviews", "Attributes")
        )
        body = (
            f'<div class="container py-5">{header(goal, keywords)}<div>'
            + form_button(url(session), "Back to Search", "btn btn-success")
            + form_button(url("search_results", session, keywords, page_num), "< Back to Results")
            + f'</div><div class="row"><div class="col-md-4"><img id="product-image" '
            f'src="/img/{asin}.jpg">{radios}</div><div class="col-md-6">'
            f"<h2>{html.escape(product['title'])}</h2><h4>Price: ${product['price']}</h4>"
            f'<h4>Rating: N.A.</h4>{subs}</div><div class="col-sm-2">'
            + form_button(url("done", session, asin, options), "Buy Now", "btn btn-lg purchase")
            + "</div></div></div>"
        )
        return 200, page(body), None

    def sub_page(self, session, asin, keywords, page_num, sub_page, options):
        goal, product = self.sessions[session], BY_ASIN[asin]
        content = {
            "Description": [product["description"] or "No Description"],
            "Features": product["features"],
            "Reviews": product["reviews"],
            "Attributes": product["attributes"],
        }[sub_page]
        items = "".join(f'<p class="product-info">{html.escape(c)}</p>' for c in content)
        return page(
            f'<div class="container py-5">{header(goal, keywords)}<div>'
            + form_button(url(session), "Back to Search", "btn btn-success")
            + form_button(
                url("item_page", session, asin, keywords, page_num, ast.literal_eval(options)),
                "< Back to Item Page",
            )
            + f'</div><div class="card card-body">{items}</div></div>'
        )

    def done(self, session, asin, options):
        goal, product, options = self.sessions[session], BY_ASIN[asin], ast.literal_eval(options)
        reward = score(product, goal, options)
        shown = (
            ""
            if asin == "B0NOSCORE1"
            else (f'<h3 id="reward">Your score (min 0.0, max 1.0)<pre>{reward}</pre></h3>')
        )
        return page(
            '<div class="container"><div id="thankyou"><h1>Thank you for shopping with '
            "us!</h1></div>"
            '<div id="stats"><h3>Your code: </h3><p><pre>'
            + html.escape(session)
            + "</pre> (Paste it"
            ' in your MTurk interface.)</p><div style="display:none"><h2>Purchased</h2>'
            f'<h4 id="asin">asin<pre>{asin}</pre></p><h4 '
            f'id="options">options<pre>{html.escape(str(options))}'
            f'</pre></h4><h4 id="goal-asin">asin<pre>{goal["asin"]}</pre></p><h4 '
            'id="goal-instruction-text">'
            f"instuction text<pre>{html.escape(goal['instruction_text'])}</pre></h4></div><hr>"
            f'{shown}<h4 hidden>Reward Details <div id="reward_info"><pre>{{}}</pre></div></h4>'
            "</div></div>"
        )


class _Handler(BaseHTTPRequestHandler):
    def _serve(self, method, form):
        status, body, location = self.server.shop.handle(method, self.path, form)
        data = body.encode()
        self.send_response(status)
        if location:
            self.send_header("Location", location)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._serve("GET", {})

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
        self._serve("POST", {k: v[0] for k, v in parse_qs(raw).items()})

    def log_message(self, *args):  # keep test output clean
        return


class WebShopTestServer:
    """`with WebShopTestServer() as server:` serves on 127.0.0.1 (a free port) in a thread;
    `server.url`, `server.shop` (goals, sessions, requests, fail_next, delay)."""

    def __init__(self, port=0, **shop_kwargs):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.shop = self.shop = Shop(**shop_kwargs)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=3000)
    parser.add_argument("--num-goals", type=int, default=520)
    cli = parser.parse_args()
    with WebShopTestServer(cli.port, num_goals=cli.num_goals) as server:
        print(f"serving a test WebShop at {server.url} (Ctrl-C stops)")
        server._thread.join()
