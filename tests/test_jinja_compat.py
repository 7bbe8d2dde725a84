"""llamapy/jinja_compat.py: the jinja2 internals the chat-template sandbox builds on are all
present in the installed jinja2, and a jinja2 lacking one is refused with one clear line."""
import jinja2.compiler
import jinja2.utils
import pytest

from llamapy import jinja_compat
from llamapy.errors import LlamapyError


def test_installed_jinja2_has_every_internal_the_sandbox_uses():
    assert jinja_compat.missing() == []
    jinja_compat.check()


def test_a_jinja2_lacking_an_internal_is_refused_with_one_line(monkeypatch):
    monkeypatch.delattr(jinja2.compiler, "Frame")
    monkeypatch.delattr(jinja2.compiler.CodeGenerator, "visit_Concat")
    monkeypatch.delattr(jinja2.utils, "generate_lorem_ipsum")
    assert jinja_compat.missing() == ["jinja2.compiler.Frame", "jinja2.compiler.CodeGenerator.visit_Concat",
                                      "jinja2.utils.generate_lorem_ipsum"]
    with pytest.raises(LlamapyError) as e:
        jinja_compat.check()
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"jinja2 {jinja2.__version__} lacks jinja2.compiler.Frame, "
                              "jinja2.compiler.CodeGenerator.visit_Concat, jinja2.utils.generate_lorem_ipsum, ")
    assert message.endswith(f"install jinja2{jinja_compat.SUPPORTED} (pip install 'jinja2{jinja_compat.SUPPORTED}')")


def test_a_jinja2_whose_namespace_hides_its_attributes_is_refused(monkeypatch):
    monkeypatch.setattr(jinja2.utils.Namespace, "__getattribute__",
                        lambda self, name: (_ for _ in ()).throw(AttributeError(name)))
    monkeypatch.setattr(jinja2.utils.Namespace, "__init__", lambda self: None)
    assert jinja_compat.missing() == ["jinja2.utils.Namespace._Namespace__attrs"]
