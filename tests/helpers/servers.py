"""Stand-in child processes for the launcher's tests (supervision, start-up waits)."""

#: a ``python -c`` program that answers GET /health with 200 on the port after ``--port``
HEALTHY = ("import sys, http.server\n"
           "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
           "class H(http.server.BaseHTTPRequestHandler):\n"
           "    def do_GET(self):\n"
           "        self.send_response(200); self.end_headers()\n"
           "    def log_message(self, *a): pass\n"
           "http.server.HTTPServer(('127.0.0.1', port), H).serve_forever()\n")
