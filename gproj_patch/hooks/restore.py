"""How every hook puts the original back at ``disable()``: by identity, only where its replacement still sits."""
import logging
from typing import Any, MutableMapping

_log = logging.getLogger("gproj_patch")
#: ``original`` for an entry that did not exist before the hook added it (restoring removes it)
ABSENT = object()


def restore_by_identity(namespace: MutableMapping[str, Any], name: str, ours: Any, original: Any,
                        where: str, change: str = "replaced") -> bool:
    """Put ``original`` back under ``namespace[name]`` (remove the entry when ``original`` is ``ABSENT``) if that
    entry still holds ``ours`` (the hook's replacement); otherwise leave whatever ``change``d it after
    ``enable()`` and say so. True when restored."""
    current = namespace.get(name)
    if current is ours:
        if original is ABSENT:
            namespace.pop(name, None)
        else:
            namespace[name] = original
        return True
    _log.warning("%s was %s after enable() (now %r); left as it is", where, change, current)
    return False
