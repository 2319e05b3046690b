"""What every tool of bench/ shares: where results go and what a recorded result carries (record.py), and
the help formatter of their command lines."""
import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: ...)" to every flag's help unless the help already states its default."""

    def _get_help_string(self, action):
        return action.help if "(default:" in (action.help or "") else super()._get_help_string(action)
