"""The rank wrapper's markers, the lines that cross from each rank's wrapper to dtrun
(standard library only). ``rankexec`` writes them; the launcher reads them (launcher/job/markers.py):

* ``dtrun-rank-start: token=T rank=R host=H`` on stderr when the wrapper starts;
* ``dtrun-rank-eof: token=T rank=R`` as its last stdout line;
* when the program failed, ``dtrun-rank-exit: token=T rank=R host=H code=C|signal=S
  [forwarded=0|1] [t=SECONDS] [start-error=WHY; program=NAME]`` on stderr.

The token is the job's random one (``MARKER_TOKEN_ENV``), so a program that prints a
marker's text is never taken for one. Both sides import this module, so the format is
written down once. The other file a rank writes, the flight recorder, has its format in
``dtrun/recorderfile.py``: the runtime writes that one, and the runtime never imports the launcher.
"""
import re

MARKER = "dtrun-rank-exit:"
START_MARKER = "dtrun-rank-start:"
EOF_MARKER = "dtrun-rank-eof:"
MARKER_TOKEN_ENV = "DTRUN_MARKER_TOKEN"
_TOKEN_RE = re.compile(r"[0-9A-Za-z]{1,64}")


def marker_head(name, token):
    """A marker's fixed start, with the job's token: ``dtrun-rank-eof: token=T`` (no token: the name)."""
    return f"{name} token={token}" if token else name


def job_token(environ):
    """The job's marker token from dtrun (letters and digits only), or "" outside dtrun."""
    token = environ.get(MARKER_TOKEN_ENV, "")
    return token if _TOKEN_RE.fullmatch(token) else ""


def start_line(token, rank, host):
    return f"{marker_head(START_MARKER, token)} rank={rank} host={host}\n"


def eof_line(token, rank):
    return f"{marker_head(EOF_MARKER, token)} rank={rank}\n"


def exit_line(token, rank, host, t, code=None, signum=None, forwarded=False, start_error=None, program=None):
    """A failed program's marker: ``code`` or ``signum`` (with ``forwarded``: the launcher was
    stopping the rank), ``t`` when it ended; ``start_error``/``program`` when it never ran."""
    how = f"signal={signum} forwarded={int(bool(forwarded))}" if signum is not None else f"code={code}"
    tail = ""
    if start_error is not None:
        why = start_error.replace(";", ",").replace("\n", " ")
        tail = f" start-error={why}; program={(program or '').replace(chr(10), ' ')}"
    return f"{marker_head(MARKER, token)} rank={rank} host={host} {how} t={t:.6f}{tail}\n"


def exit_regex(token):
    """The exit marker's pattern; groups: rank, host, code|signal, value, forwarded, t, start-error, program."""
    return (re.escape(marker_head(MARKER, token)) + r" rank=(\S+) host=(\S+) (code|signal)=(-?\d+)"
            r"(?: forwarded=([01]))?(?: t=(\d+(?:\.\d+)?))?(?: start-error=([^;]*); program=(.*))?")


def start_regex(token):
    """The start marker's pattern; groups: rank, host."""
    return re.escape(marker_head(START_MARKER, token)) + r" rank=(\S+) host=(\S+)"


def eof_head(token):
    """The end-of-output marker up to its rank number."""
    return marker_head(EOF_MARKER, token) + " rank="
