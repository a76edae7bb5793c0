"""Entry point of the ``aegis`` command. Each sub-command lives in its own module."""

from __future__ import annotations

import sys

import typer
from typer._click import exceptions as click_errors

from aegis.cli import (
    agent_cmd,
    auth_cmd,
    check_cmd,
    ctl_cmd,
    incidents_cmd,
    master_cmd,
    operator_cmd,
    replay_cmd,
    run_cmd,
    simulate_cmd,
    slurm_cmd,
    status_cmd,
    verify_cmd,
    webhook_cmd,
)
from aegis.core.errors import SetupError

app = typer.Typer(
    name="aegis",
    help="Fault tolerance for synchronous distributed training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

for module in (
    verify_cmd,
    replay_cmd,
    run_cmd,
    agent_cmd,
    auth_cmd,
    simulate_cmd,
    check_cmd,
    slurm_cmd,
    operator_cmd,
    status_cmd,
    incidents_cmd,
    ctl_cmd,
    master_cmd,
    webhook_cmd,
):
    module.register(app)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; a usage error is one readable line on stderr and exit status 2."""
    try:
        result = app(args=argv, prog_name="aegis", standalone_mode=False)
    except click_errors.NoArgsIsHelpError as exc:
        print(exc.format_message() if hasattr(exc, "format_message") else str(exc))
        return 2
    except click_errors.UsageError as exc:
        path = exc.ctx.command_path if exc.ctx else ""  # "aegis slurm submit"
        hint = f" (see '{path} --help')" if path and path != "aegis" else ""
        print(f"aegis: error: {exc.format_message()}{hint}", file=sys.stderr)
        return 2
    except typer.Exit as exc:
        return int(exc.exit_code)
    except typer.Abort:
        print("aegis: aborted", file=sys.stderr)
        return 130
    except click_errors.ClickException as exc:
        print(f"aegis: error: {exc.format_message()}", file=sys.stderr)
        return exc.exit_code
    except SetupError as exc:
        print(f"aegis: error: {exc}", file=sys.stderr)
        return 1
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
