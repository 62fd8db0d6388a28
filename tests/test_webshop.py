"""tests/test_webshop.py: the WebShop adapter (webshop.py) against the small WebShop-shaped server
of tests/webshop_server.py on 127.0.0.1, and with no server at all."""

import os
import socket
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from webshop_server import WebShopTestServer  # noqa: E402

import envs  # noqa: E402
from extras import webshop  # noqa: E402

# Goal 500 (the first training goal) of the test server: product B000SHOE01, options color black
# and size 11 (make_goal: index % len(values)), 2 attributes, price under the limit.
GOAL = "webshop/500"
WIN = [
    "search[trail running shoes]",
    "click[b000shoe01]",
    "click[black]",
    "click[11]",
    "click[buy now]",
]


@pytest.fixture(scope="module")
def server():
    with WebShopTestServer(num_goals=520, page_size=2) as srv:
        yield srv


@pytest.fixture
def env(server):
    server.shop.fail_next, server.shop.delay = 0, 0.0
    env = webshop.WebShopEnv(
        url=server.url, split="train", num_goals=520, max_steps=15, retries=2, backoff=0.01
    )
    yield env
    env.close()


def play(env, actions):
    return [env.step(a) for a in actions]


def test_tasks_follow_the_standard_split():
    assert webshop.WebShopEnv(split="test").tasks == [f"webshop/{i}" for i in range(500)]
    train = webshop.WebShopEnv(split="train").tasks
    assert (train[0], train[-1], len(train)) == ("webshop/500", "webshop/12086", 12087 - 500)
    assert webshop.WebShopEnv(split="train", num_goals=503).tasks == [
        "webshop/500",
        "webshop/501",
        "webshop/502",
    ]
    with pytest.raises(ValueError, match="'train' or 'test'"):
        webshop.WebShopEnv(split="valid_seen")
    with pytest.raises(ValueError, match="no train goals"):
        webshop.WebShopEnv(split="train", num_goals=500)
    with pytest.raises(ValueError, match="http://"):
        webshop.WebShopEnv(url="localhost:3000")


def test_reset_shows_the_search_page_of_the_fixed_goal(env, server):
    obs, info = env.reset(GOAL)
    goal = server.shop.goals[500]["instruction_text"]
    assert info["goal"] == goal and info["task"] == GOAL and info["task_type"] == "webshop"
    assert info["admissible"] == ["search[<query>]"] and info["state"] == "index"
    assert obs == f"WebShop [SEP] Instruction: [SEP] {goal} [SEP] Search"
    assert "fixed_500" in server.shop.sessions


def test_winning_episode_scores_ten(env):
    env.reset(GOAL)
    steps = play(env, WIN)
    states = [info["state"] for _, _, _, info in steps]
    assert states == [
        "search_results/trail running shoes/1",
        "item_page/B000SHOE01/trail running shoes/1/{}",
        'item_page/B000SHOE01/trail running shoes/1/{"color": "black"}',
        'item_page/B000SHOE01/trail running shoes/1/{"color": "black", "size": "11"}',
        'done/B000SHOE01/{"color": "black", "size": "11"}',
    ]
    assert [r for _, r, _, _ in steps] == [0.0, 0.0, 0.0, 0.0, 10.0]
    assert [d for _, _, d, _ in steps] == [False, False, False, False, True]
    obs, _, _, info = steps[-1]
    assert info["won"] and info["valid"] and info["score"] == 1.0
    assert obs.endswith("Your score (min 0.0, max 1.0) [SEP] 1.0")
    assert "goal-asin" not in obs and "B000SHOE01" not in obs  # the hidden goal details stay hidden
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("click[back to search]")


def test_item_page_marks_clickables_and_selected_options(env):
    env.reset(GOAL)
    obs, _, _, info = play(env, WIN[:3])[-1]
    assert info["admissible"] == [
        "click[back to search]",
        "click[< back to results]",
        "click[black]",
        "click[blue]",
        "click[9]",
        "click[10]",
        "click[11]",
        "click[description]",
        "click[features]",
        "click[reviews]",
        "click[attributes]",
        "click[buy now]",
    ]
    assert "[clicked button] black [clicked button_]" in obs
    assert "[button] blue [button_]" in obs and "[button] Buy Now [button_]" in obs
    assert obs.startswith("Instruction: i need men's trail running shoes")


def test_partial_purchase_scores_below_ten(env):
    env.reset(GOAL)
    _, reward, done, info = play(env, ["search[shoes]", "click[b000shoe01]", "click[buy now]"])[-1]
    # no options chosen: (2 attributes + 0 of 2 options + price) / (2 + 2 + 1) = 0.6
    assert done and not info["won"] and info["score"] == pytest.approx(0.6)
    assert reward == pytest.approx(6.0)
    env.reset(GOAL)
    _, reward, _, info = play(env, ["search[mug]", "click[b000mug001]", "click[buy now]"])[-1]
    assert reward == 0.0 and info["score"] == 0.0 and not info["won"]  # wrong product type


def test_navigation_pages_and_back_buttons(env):
    env.reset(GOAL)
    steps = play(
        env,
        [
            "search[running shoes]",
            "click[next >]",
            "click[< prev]",
            "click[b000shoe02]",
            "click[description]",
            "click[< back to item page]",
            "click[reviews]",
            "click[back to search]",
        ],
    )
    states = [info["state"] for _, _, _, info in steps]
    assert states == [
        "search_results/running shoes/1",
        "search_results/running shoes/2",
        "search_results/running shoes/1",
        "item_page/B000SHOE02/running shoes/1/{}",
        "item_sub_page/B000SHOE02/running shoes/1/Description/{}",
        "item_page/B000SHOE02/running shoes/1/{}",
        "item_sub_page/B000SHOE02/running shoes/1/Reviews/{}",
        "index",
    ]
    assert all(info["valid"] for _, _, _, info in steps)
    assert (
        "click[next >]" in steps[0][3]["admissible"]
        and "click[< prev]" in steps[1][3]["admissible"]
    )
    assert "Classic boots." in steps[4][0]
    assert steps[-1][3]["admissible"] == ["search[<query>]"]
    _, _, _, info = env.step("click[b000shoe02]")  # a product of the earlier page is gone now
    assert not info["valid"]


def test_state_key_sorts_options(env):
    env.reset(GOAL)
    a = play(env, ["search[shoes]", "click[b000shoe01]", "click[11]", "click[black]"])[-1][3][
        "state"
    ]
    env.reset(GOAL)
    b = play(env, ["search[shoes]", "click[b000shoe01]", "click[black]", "click[11]"])[-1][3][
        "state"
    ]
    assert a == b


@pytest.mark.parametrize(
    "action",
    [
        "buy it",
        "click[purple]",
        "click[]",
        "search[]",
        "search[<query>]",
        "search[socks]",
        None,
        "click[buy now",
    ],
)
def test_invalid_action_is_an_invalid_step(env, action):
    env.reset(GOAL)
    before, _, _, before_info = play(env, ["search[shoes]", "click[b000shoe01]"])[-1]
    obs, reward, done, info = env.step(action)  # search[socks]: no search box on an item page
    assert (obs, reward, done, info["valid"]) == (before, 0.0, False, False)
    assert info["state"] == before_info["state"] and info["error"]
    assert info["admissible"] == before_info["admissible"]


@pytest.mark.parametrize(
    "query, asin, why",
    [
        ("broken", "b0broken01", "HTTP 500"),
        ("garbled", "b0garbled1", "unparsable page"),
        ("blank", "b0blank001", "nothing to click"),
    ],
)
def test_failing_or_unparsable_page_is_an_invalid_step(env, query, asin, why):
    env.reset(GOAL)
    obs, _, _, info = env.step(f"search[{query}]")
    assert info["admissible"] == ["click[back to search]", f"click[{asin}]"]
    obs2, reward, done, info2 = env.step(f"click[{asin}]")
    assert (obs2, reward, done, info2["valid"]) == (obs, 0.0, False, False)
    assert why in info2["error"] and info2["state"] == info["state"]
    assert info2["admissible"] == info["admissible"]


def test_done_page_without_a_score_is_an_invalid_step(env):
    env.reset(GOAL)
    before = play(env, ["search[mystery]", "click[b0noscore1]"])[-1][3]
    _, reward, done, info = env.step("click[buy now]")
    assert (reward, done, info["valid"]) == (0.0, False, False) and "no score" in info["error"]
    assert info["state"] == before["state"]


def test_max_steps_ends_the_episode_with_no_reward(server):
    env = webshop.WebShopEnv(url=server.url, split="train", num_goals=520, max_steps=2)
    env.reset(GOAL)
    assert env.step("search[shoes]")[2] is False
    _, reward, done, info = env.step("click[nothing]")
    assert (reward, done, info["won"], info["truncated"]) == (0.0, True, False, True)


def test_unknown_task_is_the_callers_error(env):
    for task in ("webshop/520", "webshop/x", "alfworld/5"):
        with pytest.raises(envs.TaskError, match="unknown WebShop task"):
            env.reset(task)


def test_transient_errors_are_retried_a_bounded_number_of_times(env, server):
    server.shop.requests.clear()
    server.shop.fail_next = 2  # two 503s, then the page: retries=2 absorbs them
    assert env.reset(GOAL)[1]["state"] == "index"
    assert len(server.shop.requests) == 3
    server.shop.requests.clear()
    server.shop.fail_next = 5  # more than the retries: exactly 3 tries, then an error
    with pytest.raises(RuntimeError, match="HTTP 503"):
        env.reset(GOAL)
    assert len(server.shop.requests) == 3


def test_a_server_too_slow_to_answer_is_a_clear_error(env, server):
    server.shop.delay = 0.5
    env.timeout, env.retries = 0.05, 1
    with pytest.raises(webshop.WebShopUnreachable, match="warm_up"):
        env.reset(GOAL)
    server.shop.delay = 0.0


def test_a_goal_the_server_lacks_or_a_foreign_server_is_a_clear_error(server):
    env = webshop.WebShopEnv(url=server.url, split="train", num_goals=700)
    with pytest.raises(RuntimeError, match="HTTP 500.*lower num_goals=700"):
        env.reset("webshop/600")  # the server has 520 goals
    env = webshop.WebShopEnv(url=server.url + "/elsewhere", split="test")
    with pytest.raises(RuntimeError, match="HTTP 404.*is it a WebShop server.*run_dev.sh"):
        env.reset("webshop/0")


def test_no_server_is_a_clear_error():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = webshop.WebShopEnv(url=url, split="test", retries=1, backoff=0.01)
    with pytest.raises(webshop.WebShopUnreachable) as caught:
        env.reset("webshop/0")
    message = str(caught.value)
    assert url in message and "./run_dev.sh" in message and "web_agent_site.app" in message
    assert isinstance(caught.value, ConnectionError)
    with pytest.raises(webshop.WebShopUnreachable, match="run_dev.sh"):
        webshop.warm_up(url)


def test_warm_up_opens_goal_zero(server):
    assert webshop.warm_up(server.url) == server.shop.goals[0]["instruction_text"]


def test_env_pool_runs_webshop_in_workers(server):
    if not hasattr(envs, "EnvPool"):
        pytest.skip("envs.py has no EnvPool yet")
    pool = envs.EnvPool(
        webshop.WebShopEnv,
        num_workers=2,
        url=server.url,
        split="train",
        num_goals=520,
        max_steps=15,
    )
    try:
        obs, infos = pool.reset([GOAL, GOAL, "webshop/501"])
        assert [i["state"] for i in infos] == ["index"] * 3 and all(o for o in obs)
        for action in WIN[:-1]:
            pool.step([action, "search[mug]" if action == WIN[0] else None, None])
        _, rewards, dones, infos = pool.step(["click[buy now]", "click[b000mug001]", None])
        assert rewards[0] == 10.0 and dones[0] and infos[0]["won"]
        assert infos[1]["state"] == "item_page/B000MUG001/mug/1/{}" and not dones[1]
    finally:
        pool.close()


def test_parser_reads_the_real_templates_quirks():
    # Shapes of the real templates: "<br>" inside the instruction, end tags that close nothing
    # (`<h4>..</h5>`, `<h4>..</p>`), the done page's hidden goal block, a script with markup.
    html = """<html><head><title>WebShop</title></head><body>
      <div id="instruction-text"><h4>Instruction:<br>find a red mug</h4></div>
      <h4 class="product-title">Mug</h5><div><h5 class="product-price">$3</h6></div>
      <form><button class="btn">&lt; Prev</button></form>
      <div style="display: none"><h4 id="asin">asin<pre>B01</pre></p>
        <h4 id="goal-asin">asin<pre>B02</pre></p><h2>Reward</h2></div>
      <h3 id="reward">Your score (min 0.0, max 1.0)<pre>0.25</pre></h3>
      <h4 hidden>Reward Details <div id="reward_info"><pre>{'r_att': 1.0}</pre></div></h4>
      <input type="radio" name="size" value="x-large"></body>
      <script>let x = "<button>not a button</button>";</script></html>"""
    page = webshop._Page(html)
    assert page.goal() == "find a red mug" and page.score() == 0.25
    assert page.chunks == [
        ("Instruction:", "text"),
        ("find a red mug", "text"),
        ("Mug", "text"),
        ("$3", "text"),
        ("< Prev", "button"),
        ("Your score (min 0.0, max 1.0)", "text"),
        ("0.25", "text"),
    ]
    assert page.radios == {"x-large": "size"} and not page.has_search
    env = webshop.WebShopEnv()
    item = {"route": "item_page", "asin": "B01", "keywords": "mug", "page": 1, "options": {}}
    targets = env._targets(page, item)  # a radio without a <label> is still clickable
    assert targets["x-large"][0]["options"] == {"size": "x-large"}
    assert targets["< prev"][0] == {"route": "search_results", "keywords": "mug", "page": 1}
