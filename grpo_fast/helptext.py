"""--help as plain text: the descriptions, epilogs and option help of grpo-fast's commands come from docstrings and
help strings written in reST (``name``, :func:`name`); these argparse formatters drop that markup before wrapping."""

from __future__ import annotations

import argparse
import re


def plain_text(text: str) -> str:
    """Help text without the reST markup of the docstrings it comes from: ``name`` and :func:`name` -> name."""
    text = re.sub(r":(?:func|class|meth|data|attr|mod|exc):`~?([^`]+)`", r"\1", text)
    return re.sub(r"``([^`]+)``", r"\1", text)


class _Plain:
    """--help through :func:`plain_text`: the descriptions, epilogs and each option's help."""

    def _format_text(self, text):
        return super()._format_text(plain_text(text))

    def _expand_help(self, action):
        return plain_text(super()._expand_help(action))


class PlainHelpFormatter(_Plain, argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written (their line breaks kept), without reST markup."""


class PlainWrappedHelpFormatter(_Plain, argparse.HelpFormatter):
    """Descriptions and epilogs re-wrapped, without reST markup (argparse's default layout)."""


# the plain formatter for the one a parser asks for (None: argparse's default, HelpFormatter)
PLAIN_FORMATTERS = {None: PlainWrappedHelpFormatter, argparse.HelpFormatter: PlainWrappedHelpFormatter,
          argparse.RawDescriptionHelpFormatter: PlainHelpFormatter}
