"""The ``ftrun`` command line: typer commands that hand off to plain functions."""
