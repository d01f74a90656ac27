"""A faster Triton interpreter for the kernels' CPU tests: the same semantics, less patching.

Triton 3.6's interpreter patches ``triton.language`` (every builtin of ``tl``, ``tl.core``,
``tl.math`` and ``tl.tensor``, found by ``inspect.getmembers``) once a launch, then again on
every call of a ``@triton.jit`` helper inside the launch, and never restores the helper's
patch. Those repeats are a third of an interpreted mHC test's time (~15,000 helper calls).
While a launch's patch is in place, a helper whose language modules it already patched
finds them patched; ``skip_nested_patches`` makes it skip the repeat. A helper that sees a
module the launch did not patch is patched as before.
"""

from __future__ import annotations

import inspect


def skip_nested_patches() -> bool:
    """Install the skip; False (and nothing changed) where the interpreter is not the one
    this was written for."""
    try:
        from triton import language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None or getattr(original, "skips_nested", False):
        return False
    patched: set[int] = set()  # the language modules the running launch patched

    def languages(fn) -> set[int]:
        return {
            id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)
        }

    def patch_lang(fn):
        langs = languages(fn)
        if patched and langs <= patched:  # a helper inside a launch: already patched
            return scope_type()
        launch = not patched
        scope = original(fn)
        patched.update(langs)
        if launch:  # the launch restores its scope when it ends: the modules are unpatched
            restore = scope.restore

            def restore_and_forget() -> None:
                restore()
                patched.clear()

            scope.restore = restore_and_forget
        return scope

    patch_lang.skips_nested = True
    interpreter._patch_lang = patch_lang
    return True
