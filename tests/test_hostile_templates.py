"""Hostile chat templates end with one line naming the template and the limit hit, in
seconds and bounded memory; every real template renders as it did before the limits.

The hostile renders run in one child process whose address space is capped
(RLIMIT_AS: what it had after importing llamapy, plus 1.5 GB) under a timeout: a render
that hung, or grew past the cap (MemoryError, or killed), fails its case. Two go through
the command lines (llamapy-finetune on a chat JSONL, llamapy-cli -st) the same way.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO_ROOT, shared_path
from test_cli_errors import assert_one_clear_line

from llamapy.chat import NAMED_TEMPLATES, ChatTemplate
from llamapy.chat_sandbox import PlainEnvironment, RenderLimits
from llamapy.errors import InputError

DATA = Path(__file__).parent / "data"
MARGIN = 1536 << 20  # bytes of address space a child may add to what importing llamapy took
FAST = {"seconds": 1.0}  # the time-limited cases stop after 1 s instead of 5

TIME = "ran longer than"
SIZE = "a render may build"
MEMORY = "a render may use"
COUNT = "a render may make"
# name -> (template, limits, what the error says)
CASES: dict[str, tuple[str, dict, str]] = {
    # the tester's cases
    "nested_ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", FAST, TIME),
    "lipsum": ("{{ lipsum(10**7) }}", {}, COUNT),
    "string_doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                        "{% endfor %}{{ ns.s }}", {}, SIZE),
    "percent_width": ("{{ '%0999999999d' % 1 }}", {}, SIZE),
    # the same, other ways
    "tilde_doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}", {}, SIZE),
    "block_doubling": ("{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s }}{% endif %}{% endmacro %}"
                       "{{ d('ab', 64) }}", {}, SIZE),
    "percent_star_width": ("{{ '%*d' % (999999999, 1) }}", {}, SIZE),
    "percent_many_fields": ("{% set s = 'x' * 1000000 %}{{ ('%s' * 100) % ((s,) * 100) }}", {}, SIZE),
    "format_filter": ("{{ '%0999999999d'|format(1) }}", {}, SIZE),
    "str_format_width": ("{{ '{:0999999999}'.format(1) }}", {}, SIZE),
    "str_format_nested_width": ("{{ '{:{}}'.format(1, 999999999) }}", {}, SIZE),
    "str_format_repeated_field": ("{% set s = 'x' * 1000000 %}{{ ('{0}' * 100).format(s) }}", {}, SIZE),
    "repetition": ("{{ 'x' * 10**9 }}", {}, SIZE),
    "list_repetition": ("{{ ([1] * 10**9)|length }}", {}, SIZE),
    "center_filter": ("{{ 'x'|center(999999999) }}", {}, SIZE),
    "center_method": ("{{ 'x'.center(999999999) }}", {}, SIZE),
    "zfill_method": ("{{ '1'.zfill(999999999) }}", {}, SIZE),
    "replace_method": ("{% set s = 'x' * 100000 %}{{ s.replace('', s) }}", {}, SIZE),
    "replace_filter": ("{% set s = 'x' * 100000 %}{{ s|replace('x', s) }}", {}, SIZE),
    "join_filter": ("{% set s = 'x' * 1000000 %}{{ ([s] * 100000)|join }}", {}, SIZE),
    "join_method": ("{% set s = 'x' * 1000000 %}{{ ''.join([s] * 100000) }}", {}, SIZE),
    "translate": ("{{ ('a' * 1000000).translate({97: 'b' * 1000}) }}", {}, SIZE),
    "indent_filter": ("{{ ('a\\n' * 1000000)|indent(1000) }}", {}, SIZE),
    "wordwrap_filter": ("{{ ('a ' * 1000000)|wordwrap(1, wrapstring='x' * 1000) }}", {}, SIZE),
    "printing_shared_lists": ("{% set l = range(100000)|list %}{{ [l] * 100000 }}", {}, SIZE),
    "tojson_shared_lists": ("{% set l = range(100000)|list %}{{ ([l] * 100000)|tojson }}", {}, SIZE),
    "tojson_indent": ("{{ [1]|tojson(indent=10**9) }}", {}, "tojson's indent"),
    "sum_of_lists": ("{% set l = range(100000)|list %}{{ ([l] * 100000)|sum(start=[])|length }}", {}, SIZE),
    "raise_exception_shared_lists": ("{% set l = range(100000)|list %}{{ raise_exception([l] * 100000) }}", {},
                                     SIZE),
    "power": ("{{ 10 ** (10 ** 8) }}", {}, "bits"),
    "squaring": ("{% set ns = namespace(x=3) %}{% for i in range(100) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
                 {}, "bits"),
    "round_precision": ("{{ 5|round(-1000000000) }}", {}, "precision"),
    "slice_count": ("{{ [1]|slice(10**9)|list|length }}", {}, COUNT),
    "macro_recursion": ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
                        FAST, TIME),
    "output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", {}, SIZE),
    "kept_strings": ("{% set ns = namespace(l=[]) %}{% set s = 'x' * 1000000 %}{% for i in range(100000) %}"
                     "{% set ns.l = ns.l + [s ~ i] %}{% endfor %}", {"memory": 256 << 20}, MEMORY),
    "mapped_strings": ("{% set s = 'x' * 1000000 %}{{ ([s] * 1000000)|map('upper')|list|length }}",
                       {"memory": 256 << 20}, MEMORY),
    "quadratic_concatenation": ("{% set ns = namespace(s='') %}{% for i in range(100000) %}{% for j in range(100) %}"
                                "{% set ns.s = ns.s ~ 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' %}{% endfor %}"
                                "{% endfor %}", FAST, TIME),
}

_CHILD = textwrap.dedent("""
    import json, resource, sys, time
    from llamapy.chat import ChatTemplate
    from llamapy.chat_sandbox import RenderLimits
    from llamapy.errors import InputError
    cases, margin = json.load(sys.stdin), int(sys.argv[1])
    vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + margin, vm + margin))
    for name, (source, limits, _) in cases.items():
        t0 = time.monotonic()
        try:
            ChatTemplate(source, f"chat template {name}", limits=RenderLimits(**limits)).render(
                [{"role": "user", "content": "Hi"}])
            outcome = "rendered"
        except InputError as e:
            outcome = "InputError: " + str(e)
        except BaseException as e:
            outcome = f"{type(e).__name__}: {e}"[:300]
        print(json.dumps([name, outcome, time.monotonic() - t0]), flush=True)
""")


@pytest.fixture(scope="module")
def outcomes() -> dict[str, tuple[str, float]]:
    """Each case's outcome ("InputError: <message>" or what else happened) and seconds."""
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(MARGIN)], input=json.dumps(CASES), capture_output=True,
                          text=True, timeout=180, cwd=REPO_ROOT)
    results = {}
    for line in proc.stdout.splitlines():
        name, outcome, seconds = json.loads(line)
        results[name] = (outcome, seconds)
    assert results, f"the child process died (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_template_stops_with_one_line(name: str, outcomes) -> None:
    assert name in outcomes, "the child process died at or before this case (memory or time)"
    outcome, seconds = outcomes[name]
    _, limits, expected = CASES[name]
    assert outcome.startswith(f"InputError: chat template {name}: rendering stopped: "), outcome
    assert expected in outcome and "\n" not in outcome
    assert seconds < RenderLimits(**limits).seconds + 2.0


ORDINARY = ["{{ (range(3)|list) * 2 }}", "{{ '%05d' % 7 }}{{ '%s-%s' % ('a', 1) }}{{ '%(x)s' % {'x': 2} }}",
            "{{ 'ab'|center(6) }}{{ 'ab'.rjust(5, '.') }}{{ 'a\tb'.expandtabs(4) }}", "{{ '{:>4}|{}'.format(1, 'x') }}",
            "{{ [1, [2], {'k': 'v'}]|tojson(indent=2) }}", "{{ 'a b a'|replace('a', 'cc') }}{{ 'a-b'.replace('-', '+') }}",
            "{{ ['x', 'y']|join(', ') }}{{ '/'.join(['p', 'q']) }}", "{{ 2 ** 10 }} {{ 7 % 3 }} {{ 3 * 4 }} {{ 1 + 2 }}",
            "{{ [1, 2]|sum }} {{ [[1], [2]]|sum(start=[]) }}", "{{ 'line\nline'|indent(2, true) }}",
            "{{ 'a ' * 3 ~ 'b' }}{% set x %}{{ 'kept' }}{% endset %}{{ x }}", "{{ lipsum(2, false, 3, 5)|wordcount > 0 }}",
            "{% for i in range(3) %}{{ loop.index }}{{ loop.last }}{% else %}none{% endfor %}",
            "{{ 3.14159|round(2) }} {{ [1, 2, 3, 4]|batch(3, 0)|list }} {{ [1, 2, 3]|slice(2)|list }}",
            "{% macro m(a) %}<{{ a }}>{% endmacro %}{{ m('x') }}{{ 'x'|wordwrap(10) }}{{ 'see www.a.io'|urlize }}"]


@pytest.mark.parametrize("source", ORDINARY)
def test_ordinary_uses_of_the_checked_operations_render_as_without_limits(source: str) -> None:
    expected = PlainEnvironment().from_string(source).render()
    assert ChatTemplate(source).render([]) == expected


def test_bad_limits_are_refused() -> None:
    for bad in ({"seconds": 0}, {"seconds": float("nan")}, {"chars": 100}, {"memory": -1}):
        with pytest.raises(InputError, match="render limits"):
            RenderLimits(**bad)


def test_templates_too_deep_to_compile_are_refused_in_one_line() -> None:
    for source in ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "{% if 1 %}" * 3000 + "{% endif %}" * 3000,
                   "{% for a in [1] %}" * 200 + "{% endfor %}" * 200):
        with pytest.raises(InputError, match="nests blocks or expressions too deeply"):
            ChatTemplate(source, "deep")


def test_a_huge_template_is_refused_before_compiling() -> None:
    with pytest.raises(InputError, match="more than the 262,144 a chat template may have"):
        ChatTemplate("{{ 1 }}" * 200000, "huge")


def test_error_messages_are_short() -> None:
    with pytest.raises(InputError) as e:
        ChatTemplate("{{ raise_exception('x' * 100000) }}", "loud").render([])
    assert len(str(e.value)) < 400
    with pytest.raises(InputError, match="has no such element"):
        ChatTemplate("{% set d = {} %}{{ d['x' * 1000000] + 1 }}", "key").render([])


# ---- every real template renders as in the plain sandbox -----------------------------------------
def real_templates() -> dict[str, str]:
    files = sorted(shared_path("data", "chat_templates").glob("*.jinja")) + [DATA / "gemma3-chat-template.jinja"]
    return {**{p.stem: p.read_text(encoding="utf-8") for p in files}, **NAMED_TEMPLATES}


@pytest.mark.parametrize("name", list(real_templates()))
def test_real_templates_render_as_without_limits(name: str) -> None:
    source = real_templates()[name]
    conversations = json.loads((DATA / "llama_cpp_chat_templates.json").read_text(encoding="utf-8"))["conversations"]
    plain = PlainEnvironment().from_string(source)
    template = ChatTemplate(source, name, "<s>", "</s>")
    rendered = 0
    for c in conversations:
        try:
            expected = plain.render(messages=c["messages"], add_generation_prompt=c["add_generation_prompt"],
                                    bos_token="<s>", eos_token="</s>", tools=None)
        except Exception:  # noqa: BLE001 - the template refuses this conversation: so must the limited one
            with pytest.raises(InputError):
                template.render(c["messages"], c["add_generation_prompt"])
            continue
        assert template.render(c["messages"], c["add_generation_prompt"]) == expected
        rendered += 1
    assert rendered >= len(conversations) // 2


# ---- through the command lines --------------------------------------------------------------------
def _capped() -> None:
    """In the child before exec: an address-space cap far above what the tools need."""
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))


def test_finetune_on_chats_stops_a_hanging_template(stories_path, tmp_path) -> None:
    template = tmp_path / "hang.jinja"
    template.write_text(CASES["nested_ranges"][0], encoding="utf-8")
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Q{i}"},
                                                     {"role": "assistant", "content": f"A{i}"}]}) + "\n"
                            for i in range(4)), encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "llamapy.cli.finetune", "-m", str(stories_path), "-f", str(data),
                           "--chat-template", str(template), "-c", "64", "-o", str(tmp_path / "out.gguf")],
                          capture_output=True, text=True, timeout=120, preexec_fn=_capped, cwd=REPO_ROOT)
    assert_one_clear_line(proc, f"chat template {template}: rendering stopped: it ran longer than 5 s")
    assert not (tmp_path / "out.gguf").exists()


def test_cli_single_turn_stops_a_huge_format(stories_path, tmp_path) -> None:
    template = tmp_path / "huge.jinja"
    template.write_text("{{ '%0999999999d' % 1 }}{% for m in messages %}{{ m.content }}{% endfor %}", encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "llamapy.cli.completion", "-m", str(stories_path), "-st", "-p", "Hi",
                           "--chat-template-file", str(template), "-n", "4"],
                          capture_output=True, text=True, timeout=120, preexec_fn=_capped, cwd=REPO_ROOT)
    assert_one_clear_line(proc, f"chat template {template}: rendering stopped: '%' formatting would make "
                                "1,000,000,013 characters")
