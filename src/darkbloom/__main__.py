"""`python -m darkbloom`: the same command line as the `darkbloom` script."""

from darkbloom.cli import app

if __name__ == "__main__":
    app(prog_name="darkbloom")
