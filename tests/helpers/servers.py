"""Stand-in child processes for the launcher's tests (supervision, start-up waits)."""

#: a ``python -c`` program that answers GET /health with 200 on the port after ``--port``
HEALTHY = ("import sys, http.server\n"
           "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
           "class H(http.server.BaseHTTPRequestHandler):\n"
           "    def do_GET(self):\n"
           "        self.send_response(200); self.end_headers()\n"
           "    def log_message(self, *a): pass\n"
           "http.server.HTTPServer(('127.0.0.1', port), H).serve_forever()\n")


def hold_port(port: int, host: str = "127.0.0.1"):
    """A context manager: another process listens on ``host:port`` (another job's engine, a slurmd)
    until the block ends; yields its Popen (its pid is what a collision report must name)."""
    import contextlib
    import subprocess
    import sys

    code = (f"import socket, time; s = socket.socket(); s.bind(({host!r}, {port})); s.listen(); "
            "print('ready', flush=True); time.sleep(120)")

    @contextlib.contextmanager
    def held():
        holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "ready", f"the holder of port {port} did not bind it"
            yield holder
        finally:
            holder.kill()
            holder.wait()
            holder.stdout.close()
    return held()
