"""Whether a file or folder that the process will load code from can only have been written by
its user (or root): the one rule the facade's caches of compiled code follow.

A compiled-code cache is code: loading an entry runs it. So a folder, and an entry in it, must
belong to this process's user or to root, and neither its group nor others may write it. The
compiled-core cache (``_engine/_core_cache.py``) applies it to its folder and entries, and the
cbfloat16 kernel to inductor's cache folder before it compiles its loop there.
"""

from __future__ import annotations

import os
import stat

__all__ = ["owner_and_mode_problem"]


def owner_and_mode_problem(info: os.stat_result, what: str, path: str) -> tuple[str, str] | None:
    """``None`` if ``info`` (of ``path``, called ``what`` in messages) belongs to this
    process's user or to root and neither its group nor others may write it; else what is wrong
    and how to fix it.

    Example:
        >>> import os, tempfile
        >>> folder = tempfile.mkdtemp()  # made for this user, mode 700
        >>> owner_and_mode_problem(os.stat(folder), "the folder", folder) is None
        True
        >>> os.chmod(folder, 0o777)
        >>> owner_and_mode_problem(os.stat(folder), "the folder", folder)[1].startswith("chmod")
        True
    """
    user = os.geteuid()
    if info.st_uid not in (user, 0):
        return (
            f"{what} belongs to user id {info.st_uid}, not to this process's user ({user})",
            f"remove {path} or make it yours (chown -R {user} {path})",
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"{what} may be written by its group or by others (mode "
            f"{stat.S_IMODE(info.st_mode):o})",
            f"chmod -R go-w {path}",
        )
    return None
