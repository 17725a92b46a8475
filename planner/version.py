"""moeplan's version: the installed distribution's, from its metadata."""

from __future__ import annotations


def moeplan_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moeplan")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"
