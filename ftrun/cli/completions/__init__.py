"""Shell completion scripts for ``ftrun``: bash, zsh and fish, generated from the live CLI.

``generate(shell)`` reads the command line's model once, at generation time, and writes it
into a *static* script: the launcher's flags come from the argparse actions of
:func:`ftrun.launcher.args.build_parser` (torchrun's parser plus ftrun's group), the
subcommands and their options from the typer app it is given (:mod:`ftrun.cli.main`'s, which
imports this package, never the reverse: ``__main__`` here is the entry point that joins
them). Nothing calls back
into ftrun at TAB time (importing torch alone takes seconds), so completion stays instant; the
price is that the scripts must be regenerated when the CLI changes, which the test suite checks::

    python -m ftrun.cli.completions --write completions/

What the scripts complete, in every shell:

* ``ftrun <TAB>``: the subcommands, the launcher's flags and files (the training script);
* after a launcher flag that takes a value: its choices when argparse declares them,
  directories for ``*-dir`` flags, files otherwise;
* once the training script is on the line, files only: the rest belongs to the script;
* ``ftrun SUBCOMMAND <TAB>``: its options, and its arguments: run ids (the directory names in
  ``${FTRUN_STATE_DIR:-~/.ftrun}/jobs/``) for ``run_id``, the shells for ``completions``.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftrun.errors import ConfigError

SHELLS = ("bash", "zsh", "fish")
FILENAMES = {"bash": "ftrun.bash", "zsh": "_ftrun", "fish": "ftrun.fish"}
REGENERATE = "python -m ftrun.cli.completions --write completions/"

LAUNCHER = "launch"  # the context name of the launcher's flags in the scripts

# How a subcommand's positional argument completes, by parameter name; any other argument
# completes its typer choices, or files.
_ARGUMENT_KINDS: dict[str, str] = {"run_id": "runs"}
_ARGUMENT_CHOICES: dict[str, tuple[str, ...]] = {"shell": SHELLS}

_MAX_HELP = 100


# ---------------------------------------------------------------------------------------------
# The model: what the command line accepts.


@dataclass(frozen=True)
class Option:
    """One flag, with all its spellings."""

    names: tuple[str, ...]
    takes_value: bool
    help: str
    choices: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """How the value completes: ``none`` (a plain flag), ``choices``, ``dirs`` or ``files``."""
        if not self.takes_value:
            return "none"
        if self.choices:
            return "choices"
        if any(re.search(r"[-_]dir$", name) for name in self.names):
            return "dirs"
        return "files"

    @property
    def key(self) -> str:
        longs = [n for n in self.names if n.startswith("--")]
        return (longs or list(self.names))[0].lstrip("-").lower()


@dataclass(frozen=True)
class Argument:
    """One positional argument of a subcommand."""

    name: str
    help: str
    kind: str  # runs | choices | files
    choices: tuple[str, ...] = ()
    variadic: bool = False


@dataclass(frozen=True)
class Command:
    """One visible subcommand."""

    name: str
    help: str
    options: tuple[Option, ...]
    arguments: tuple[Argument, ...]


@dataclass(frozen=True)
class Model:
    launcher: tuple[Option, ...]
    commands: tuple[Command, ...]


def first_sentence(text: str | None) -> str:
    """The first sentence of a help text, on one line, at most ``_MAX_HELP`` characters."""
    text = " ".join((text or "").split())
    text = re.sub(r"%\(prog\)s", "ftrun", text).replace("%%", "%")
    text = re.split(r"(?<=[.!?])\s+(?=[A-Z])", text, maxsplit=1)[0]
    if len(text) > _MAX_HELP:
        text = text[: _MAX_HELP - 3].rsplit(" ", 1)[0]
        if text.count("(") > text.count(")"):  # drop a parenthesis cut in the middle
            text = text[: text.rindex("(")]
        text = text.rstrip(" ,;:") + "..."
    return text


def _unique(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def launcher_options(parser: argparse.ArgumentParser) -> tuple[Option, ...]:
    """Every optional action of the launcher's parser (hidden ones left out), sorted."""
    options = [
        Option(
            names=_unique(action.option_strings),
            takes_value=action.nargs != 0,
            help=first_sentence(action.help),
            choices=tuple(str(c) for c in action.choices or ()),
        )
        for action in parser._actions
        if action.option_strings and action.help != argparse.SUPPRESS
    ]
    return tuple(sorted(options, key=lambda o: (o.key, o.names)))


def _choices(param: Any) -> tuple[str, ...]:
    descriptor = getattr(param, "type_descriptor", None)  # typer >= 0.26
    choices = getattr(descriptor, "choices", None)
    if choices is None:  # older typer: a click.Choice
        choices = getattr(getattr(param, "type", None), "choices", None)
    return tuple(str(getattr(c, "value", c)) for c in choices or ())


def _command(name: str, command: Any, parent_ctx: Any) -> Command:
    ctx = command.context_class(command, info_name=name, parent=parent_ctx)
    options: list[Option] = []
    arguments: list[Argument] = []
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False):
            continue
        help_text = first_sentence(getattr(param, "help", None))
        if param.param_type_name == "argument":
            choices = _ARGUMENT_CHOICES.get(param.name) or _choices(param)
            kind = _ARGUMENT_KINDS.get(param.name) or ("choices" if choices else "files")
            arguments.append(Argument(param.name, help_text, kind, choices, param.nargs == -1))
        else:
            flag = getattr(param, "is_flag", False) or getattr(param, "count", False)
            options.append(Option(
                names=_unique([*param.opts, *param.secondary_opts]),
                takes_value=not flag, help=help_text, choices=_choices(param),
            ))
    return Command(
        name=name,
        help=first_sentence(command.help or command.short_help),
        options=tuple(sorted(options, key=lambda o: (o.key, o.names))),
        arguments=tuple(arguments),
    )


def subcommands(group: Any) -> tuple[Command, ...]:
    """The visible subcommands of a click/typer group, sorted by name."""
    root = group.context_class(group, info_name="ftrun")
    return tuple(
        _command(name, command, root)
        for name, command in sorted(group.commands.items())
        if not getattr(command, "hidden", False)
    )


def build_model(app: Any) -> Model:
    """Read the live CLI: torchrun's and ftrun's launcher flags, and the subcommands of the
    typer ``app`` (``ftrun.cli.main.app``)."""
    import typer.main

    from ftrun.launcher.args import build_parser

    return Model(launcher_options(build_parser()), subcommands(typer.main.get_command(app)))


# ---------------------------------------------------------------------------------------------
# Quoting.


def sh_quote(text: str) -> str:
    """``text`` single-quoted for bash and zsh."""
    return "'" + text.replace("'", "'\\''") + "'"


def fish_quote(text: str) -> str:
    """``text`` single-quoted for fish (where ``\\`` and ``'`` are escaped inside quotes)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _wrap(items: Sequence[str], indent: str, first: int = 0, joiner: str = "\n") -> str:
    """Items separated by spaces, on lines of at most 100 characters (the first line starting
    at column ``first``, the others at ``indent``); ``joiner`` ends all lines but the last."""
    lines: list[str] = []
    line, width = "", first
    for item in items:
        if line and width + len(line) + 1 + len(item) > 96:
            lines.append(line)
            line, width = "", len(indent)
        line = f"{line} {item}" if line else item
    lines.append(line)
    return (joiner + indent).join(lines)


def _header(shell: str, install: str) -> str:
    lines = [
        f"ftrun completion for {shell}.",
        f"Generated by `ftrun completions {shell}`: do not edit. To regenerate the copy in",
        f"ftrun's repository, run `{REGENERATE}`.",
        "",
        *install.splitlines(),
    ]
    return "\n".join(f"# {line}".rstrip() for line in lines) + "\n"


# ---------------------------------------------------------------------------------------------
# bash


def _bash_value(kind: str, choices: Sequence[str]) -> str:
    """A value kind as the bash script spells it: ``choices WORD...`` or the kind itself."""
    return sh_quote("choices " + " ".join(choices) if kind == "choices" else kind)


def _bash_argument_cases(command: Command) -> str:
    arms = [f"{i}) _ftrun_k={_bash_value(a.kind, a.choices)} ;;"
            for i, a in enumerate(command.arguments) if not a.variadic]
    rest = command.arguments[-1] if command.arguments and command.arguments[-1].variadic else None
    arms.append(f"*) _ftrun_k={_bash_value(rest.kind, rest.choices) if rest else 'none'} ;;")
    return "\n".join(" " * 16 + arm for arm in arms)


def _bash(model: Model) -> str:
    contexts = [(LAUNCHER, model.launcher)] + [(c.name, c.options) for c in model.commands]
    kind_arms = []
    for context, options in contexts:
        for option in options:
            if option.takes_value:
                pattern = " | ".join(sh_quote(f"{context} {name}") for name in option.names)
                kind_arms.append(f"        {pattern}) _ftrun_k={_bash_value(option.kind, option.choices)} ;;")
    launcher_flags = [n for o in model.launcher for n in o.names]
    command_arms = [
        f"        {LAUNCHER})\n"
        f"            _ftrun_opts={sh_quote(_wrap(launcher_flags, ' ' * 16, 25))}\n"
        f"            _ftrun_k=none ;;"
    ]
    for command in model.commands:
        flags = [n for o in command.options for n in o.names]
        command_arms.append(
            f"        {command.name})\n"
            f"            _ftrun_opts={sh_quote(_wrap(flags, ' ' * 16, 25))}\n"
            f"            case $2 in\n{_bash_argument_cases(command)}\n            esac ;;"
        )
    names = [c.name for c in model.commands]
    install = (
        "Install: `source` this file from ~/.bashrc, or copy it to /etc/bash_completion.d/ftrun\n"
        "(bash-completion 2 also loads ~/.local/share/bash-completion/completions/ftrun).\n"
        "Needs bash 4 or newer."
    )
    return (
        _header("bash", install)
        + _BASH_TEMPLATE.replace("@KIND_ARMS@", "\n".join(kind_arms))
        .replace("@COMMAND_ARMS@", "\n".join(command_arms))
        .replace("@SUBCOMMAND_PATTERN@", " | ".join(names) or "''")
        .replace("@SUBCOMMANDS@", sh_quote(" ".join(names)))
    )


_BASH_TEMPLATE = r"""
# _ftrun_kind CONTEXT FLAG: set _ftrun_k to how the value of FLAG completes, where CONTEXT is
# `launch` (the launcher: torchrun's flags and ftrun's) or a subcommand: files, dirs,
# "choices WORD...", or none for a flag that takes no value.
_ftrun_kind() {
    case "$1 $2" in
@KIND_ARMS@
        *) _ftrun_k=none ;;
    esac
}

# _ftrun_command CONTEXT N: set _ftrun_opts to the flags of CONTEXT and _ftrun_k to how its
# positional argument number N (from 0) completes: runs, files, "choices WORD...", or none.
_ftrun_command() {
    case $1 in
@COMMAND_ARMS@
    esac
}

# _ftrun_add COMPGEN-ARGS...: append compgen's matches to COMPREPLY, one per line.
_ftrun_add() {
    local line
    while IFS= read -r line; do
        COMPREPLY+=("$line")
    done < <(compgen "$@")
}

# _ftrun_files -f|-d PREFIX: complete file (or directory) names.
_ftrun_files() {
    compopt -o filenames 2>/dev/null
    _ftrun_add "$1" -- "$2"
}

# _ftrun_run_ids PREFIX: complete the run ids, the directory names in the jobs/ directory
# of the state directory (FTRUN_STATE_DIR, by default ~/.ftrun).
_ftrun_run_ids() {
    local dir=${FTRUN_STATE_DIR:-$HOME/.ftrun} job
    case $dir in
        '~' | '~/'*) dir=$HOME${dir#'~'} ;;
    esac
    for job in "$dir"/jobs/"$1"*/; do
        if [[ -d $job ]]; then
            job=${job%/}
            COMPREPLY+=("${job##*/}")
        fi
    done
}

_ftrun() {
    local IFS=$' \t\n' cur=${COMP_WORDS[COMP_CWORD]} context=launch i=1 npos=0 word value=
    local _ftrun_k _ftrun_opts
    COMPREPLY=()
    # A subcommand is only ever the first word; anything else goes to the launcher.
    case ${COMP_WORDS[1]} in
        @SUBCOMMAND_PATTERN@)
            if ((COMP_CWORD > 1)); then
                context=${COMP_WORDS[1]}
                i=2
            fi ;;
    esac
    # Walk the words before the cursor: skip the flags' values, count the positional words.
    # The launcher's first positional word is the training script.
    while ((i < COMP_CWORD)); do
        word=${COMP_WORDS[i]}
        if [[ $word == -?* ]]; then
            [[ $word == *=* ]] || _ftrun_kind "$context" "$word"
            if [[ $word != *=* && $_ftrun_k != none ]]; then
                ((++i))
                # `--flag=value`: COMP_WORDBREAKS splits it into `--flag`, `=`, `value`.
                [[ $i -lt $COMP_CWORD && ${COMP_WORDS[i]} == = ]] && ((++i))
                if ((i >= COMP_CWORD)); then
                    value=$_ftrun_k
                    break
                fi
            fi
        else
            ((++npos))
            [[ $context == launch ]] && break
        fi
        ((++i))
    done

    # After the training script everything belongs to the script: files only.
    if [[ $context == launch ]] && ((npos > 0)); then
        _ftrun_files -f "$cur"
        return 0
    fi

    # The value of a flag.
    if [[ -n $value ]]; then
        [[ $cur == = ]] && cur=
        case $value in
            files) _ftrun_files -f "$cur" ;;
            dirs) _ftrun_files -d "$cur" ;;
            choices\ *) _ftrun_add -W "${value#choices }" -- "$cur" ;;
        esac
        return 0
    fi

    _ftrun_command "$context" "$npos"
    if [[ $cur == -* ]]; then
        _ftrun_add -W "$_ftrun_opts" -- "$cur"
        return 0
    fi
    if [[ $context == launch ]]; then
        # The first word: a subcommand, a flag, or the training script.
        ((COMP_CWORD == 1)) && _ftrun_add -W @SUBCOMMANDS@ -- "$cur"
        [[ -z $cur ]] && _ftrun_add -W "$_ftrun_opts" -- "$cur"
        _ftrun_files -f "$cur"
        return 0
    fi
    [[ -z $cur || $_ftrun_k == none ]] && _ftrun_add -W "$_ftrun_opts" -- "$cur"
    case $_ftrun_k in
        runs) _ftrun_run_ids "$cur" ;;
        files) _ftrun_files -f "$cur" ;;
        choices\ *) _ftrun_add -W "${_ftrun_k#choices }" -- "$cur" ;;
    esac
    return 0
}

complete -F _ftrun ftrun
"""


# ---------------------------------------------------------------------------------------------
# zsh


def _zsh_escape(text: str) -> str:
    """Escape the characters that end or split a description or message in an _arguments spec."""
    return re.sub(r"([\\\[\]:])", r"\\\1", text)


def _zsh_words(words: Sequence[str]) -> str:
    return " ".join(re.sub(r"([^\w.+/@%,=-])", r"\\\1", w) for w in words)


def _zsh_action(kind: str, choices: Sequence[str]) -> str:
    return {"files": "_files", "dirs": "_files -/", "runs": "_ftrun_run_ids"}.get(
        kind, f"({_zsh_words(choices)})"
    )


def _zsh_option_specs(option: Option) -> list[str]:
    exclusive = f"({' '.join(option.names)})" if len(option.names) > 1 else ""
    specs = []
    for name in option.names:
        spec = f"{exclusive}{name}"
        if option.takes_value:
            spec += "+" if re.fullmatch(r"-\w", name) else "="
        spec += f"[{_zsh_escape(option.help)}]"
        if option.takes_value:
            message = _zsh_escape(option.key.replace("-", " ").replace("_", " "))
            spec += f":{message}:{_zsh_action(option.kind, option.choices)}"
        specs.append(sh_quote(spec))
    return specs


def _zsh_arguments(specs: Sequence[str], flags: str) -> str:
    lines = [f"_arguments {flags} :", *specs]
    return " \\\n        ".join(lines)


def _zsh(model: Model) -> str:
    functions = []
    for command in model.commands:
        specs = [s for o in command.options for s in _zsh_option_specs(o)]
        for i, arg in enumerate(command.arguments, start=1):
            position = "*" if arg.variadic else str(i)
            message = _zsh_escape(arg.name.replace("_", " "))
            specs.append(sh_quote(f"{position}:{message}:{_zsh_action(arg.kind, arg.choices)}"))
        functions.append(
            f"# ftrun {command.name}: {command.help}\n"
            f"_ftrun_{command.name}() {{\n    {_zsh_arguments(specs, '-S')}\n}}\n"
        )
    launcher_specs = [s for o in model.launcher for s in _zsh_option_specs(o)]
    launcher_specs += [sh_quote("1:training script:_ftrun_first"),
                       sh_quote("*::script argument:_files")]
    described = "\n".join(
        "        " + sh_quote(f"{_zsh_escape(c.name)}:{c.help}") for c in model.commands
    )
    install = (
        "Install: put this file, named _ftrun, in a directory on $fpath before compinit runs\n"
        "(e.g. `fpath=(~/.zfunc $fpath)` in ~/.zshrc); or `source` it after compinit."
    )
    return (
        "#compdef ftrun\n"
        + _header("zsh", install)
        + _ZSH_TEMPLATE.replace("@SUBCOMMAND_FUNCTIONS@", "\n".join(functions))
        .replace("@SUBCOMMANDS@", described)
        .replace("@SUBCOMMAND_PATTERN@", "|".join(c.name for c in model.commands) or "''")
        .replace("@LAUNCHER_ARGUMENTS@", _zsh_arguments(launcher_specs, "-S -A '-*'"))
    )


_ZSH_TEMPLATE = r"""
# Complete the run ids: the directory names in the jobs/ directory of the state directory
# (FTRUN_STATE_DIR, by default ~/.ftrun).
_ftrun_run_ids() {
    local dir=${FTRUN_STATE_DIR:-$HOME/.ftrun} expl
    [[ $dir == '~' || $dir == '~/'* ]] && dir=$HOME${dir#\~}
    local -a ids
    ids=( $dir/jobs/*(N/:t) )
    _wanted run-ids expl 'run id' compadd -a ids
}

# The first word: a subcommand, or the training script.
_ftrun_first() {
    local ret=1
    local -a subcommands
    subcommands=(
@SUBCOMMANDS@
    )
    if (( CURRENT == 2 )); then
        _describe -t subcommands 'ftrun subcommand' subcommands && ret=0
    fi
    _files && ret=0
    return ret
}

@SUBCOMMAND_FUNCTIONS@
_ftrun() {
    local curcontext=$curcontext
    if (( CURRENT > 2 )); then
        case $words[2] in
            (@SUBCOMMAND_PATTERN@)
                local subcommand=$words[2]
                shift words
                (( CURRENT-- ))
                curcontext=${curcontext%:*:*}:ftrun-$subcommand:
                _ftrun_$subcommand
                return ;;
        esac
    fi
    # The launcher: torchrun's flags and ftrun's, up to the training script (-A); the words
    # after the script are the script's own.
    @LAUNCHER_ARGUMENTS@
}

if [[ $zsh_eval_context[-1] == loadautofunc ]]; then
    _ftrun "$@"  # autoloaded from $fpath by compinit
else
    compdef _ftrun ftrun  # sourced
fi
"""


# ---------------------------------------------------------------------------------------------
# fish


def _fish_names(option: Option) -> str:
    parts = []
    for name in option.names:
        if name.startswith("--"):
            parts.append(f"-l {fish_quote(name[2:])}")
        elif len(name) == 2:
            parts.append(f"-s {fish_quote(name[1:])}")
        else:
            parts.append(f"-o {fish_quote(name[1:])}")
    return " ".join(parts)


def _fish_value(kind: str, choices: Sequence[str]) -> str:
    if kind == "none":
        return ""
    if kind == "files":
        return " -r"
    if kind == "dirs":
        return " -x -a '(__fish_complete_directories (commandline -ct))'"
    if kind == "runs":
        return " -a '(__ftrun_run_ids)'"
    return f" -x -a {fish_quote(' '.join(choices))}"


def _fish_option(condition: str, option: Option) -> str:
    return (
        f"complete -c ftrun -n {fish_quote(condition)} {_fish_names(option)}"
        f"{_fish_value(option.kind, option.choices)} -d {fish_quote(option.help)}"
    )


def _fish(model: Model) -> str:
    contexts = [(LAUNCHER, model.launcher)] + [(c.name, c.options) for c in model.commands]
    value_flags = [
        fish_quote(f"{context} {name}")
        for context, options in contexts
        for option in options
        if option.takes_value
        for name in option.names
    ]
    lines = ["# Subcommands: only ever the first word."]
    for command in model.commands:
        lines.append(f"complete -c ftrun -n '__ftrun_is first' -a {fish_quote(command.name)} "
                     f"-d {fish_quote(command.help)}")
    lines += ["", "# The launcher: torchrun's flags and ftrun's, up to the training script;",
              "# files for the script and, after it, for the script's own arguments."]
    lines += [_fish_option("__ftrun_is first launch", o) for o in model.launcher]
    lines.append("complete -c ftrun -n '__ftrun_is first launch script' -F")
    for command in model.commands:
        lines += ["", f"# ftrun {command.name}"]
        lines += [_fish_option(f"__ftrun_in {command.name}", o) for o in command.options]
        for i, arg in enumerate(command.arguments):
            position = f"{i}+" if arg.variadic else str(i)
            condition = fish_quote(f"__ftrun_arg {command.name} {position}")
            if arg.kind == "choices":  # each choice speaks for itself
                what = f"-a {fish_quote(' '.join(arg.choices))}"
            else:
                what = "-F" if arg.kind == "files" else _fish_value(arg.kind, ()).strip()
                what += f" -d {fish_quote(arg.help)}"
            lines.append(f"complete -c ftrun -n {condition} {what}")
    install = (
        "Install: copy this file to ~/.config/fish/completions/ftrun.fish\n"
        "(or `ftrun completions fish > ~/.config/fish/completions/ftrun.fish`)."
    )
    return (
        _header("fish", install)
        + _FISH_TEMPLATE.replace("@VALUE_FLAGS@", _wrap(value_flags, " " * 12, 13, " \\\n"))
        .replace("@SUBCOMMANDS@", " ".join(fish_quote(c.name) for c in model.commands))
        + "\n".join(lines).rstrip()
        + "\n"
    )


_FISH_TEMPLATE = r"""
complete -c ftrun -e
complete -c ftrun -f

# __ftrun_takes_value CONTEXT FLAG: whether FLAG takes a value, where CONTEXT is `launch` (the
# launcher: torchrun's flags and ftrun's) or a subcommand.
function __ftrun_takes_value --argument-names context flag
    switch "$context $flag"
        case @VALUE_FLAGS@
            return 0
    end
    return 1
end

# Print where the word being completed is: `first` (the first word), `launch` (after some
# launcher flags), `script` (after the training script), or `SUBCOMMAND N` (after N of the
# subcommand's positional words).
function __ftrun_where
    set -l words (commandline -opc)
    set -e words[1]
    if not set -q words[1]
        echo first
        return
    end
    set -l context launch
    if contains -- $words[1] @SUBCOMMANDS@
        set context $words[1]
        set -e words[1]
    end
    set -l npos 0
    set -l skip 0
    for word in $words
        if test $skip = 1
            set skip 0
        else if string match -q -- '-?*' $word
            if not string match -q -- '*=*' $word; and __ftrun_takes_value $context $word
                set skip 1
            end
        else if test $context = launch
            echo script
            return
        else
            set npos (math $npos + 1)
        end
    end
    if test $context = launch
        echo launch
    else
        echo $context $npos
    end
end

# __ftrun_is WHERE...: whether the word being completed is at one of these places.
function __ftrun_is
    contains -- (__ftrun_where) $argv
end

# __ftrun_in SUBCOMMAND: whether the word being completed belongs to SUBCOMMAND.
function __ftrun_in --argument-names subcommand
    string match -q -- "$subcommand *" (__ftrun_where)
end

# __ftrun_arg SUBCOMMAND N[+]: whether the word is SUBCOMMAND's positional argument N (from 0;
# N+: N or later).
function __ftrun_arg --argument-names subcommand position
    set -l where (string split ' ' -- (__ftrun_where))
    test "$where[1]" = "$subcommand"; and set -q where[2]; or return 1
    if string match -q -- '*+' $position
        test $where[2] -ge (string trim -r -c + -- $position)
    else
        test $where[2] -eq $position
    end
end

# The run ids: the directory names in the jobs/ directory of the state directory
# (FTRUN_STATE_DIR, by default ~/.ftrun).
function __ftrun_run_ids
    set -l dir $HOME/.ftrun
    if set -q FTRUN_STATE_DIR; and test -n "$FTRUN_STATE_DIR"
        set dir (string replace -r '^~(?=/|$)' $HOME -- $FTRUN_STATE_DIR)
    end
    for job in $dir/jobs/*/
        string replace -r '^.*/([^/]+)/$' '$1' -- $job
    end
end

"""


# ---------------------------------------------------------------------------------------------


_RENDERERS = {"bash": _bash, "zsh": _zsh, "fish": _fish}


def generate(shell: str, model: Model | Callable[[], Model]) -> str:
    """The completion script for ``shell`` (bash, zsh or fish) from ``model``, or from what
    ``model()`` builds (``build_model`` imports torch: only for a shell that exists)."""
    render = _RENDERERS.get(shell)
    if render is None:
        raise ConfigError(
            f"unknown shell {shell!r}: completions exist for {', '.join(SHELLS)}"
        )
    return render(model if isinstance(model, Model) else model())


def write(directory: str | Path, app: Any) -> list[Path]:
    """Write the three scripts for the typer ``app`` into ``directory``; return their paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(app)
    paths = []
    for shell in SHELLS:
        path = out / FILENAMES[shell]
        path.write_text(generate(shell, model), encoding="utf-8")
        paths.append(path)
    return paths
