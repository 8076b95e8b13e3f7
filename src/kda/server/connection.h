// The client connection behind a request, for a handler that answers in one piece. httplib 0.11 gives a
// plain handler no socket and only learns that a client left when a write fails, which a non-streaming
// response makes once, at its end. The connection is found by its address pair (the one socket of this
// process with that local and peer address), then polled while the engine works: a client that closed
// it, or reset it, has gone. The socket stays httplib's: it is never read, written or closed here, and
// httplib closes it only after the handler returns.
#pragma once

#include <string>

namespace kda::server {

class ClientConnection {
 public:
  // The socket whose local address is local_addr:local_port and whose peer is remote_addr:remote_port
  // (numeric hosts, as httplib::Request gives them). None found: gone() is always false.
  ClientConnection(const std::string& local_addr, int local_port, const std::string& remote_addr,
                   int remote_port);
  bool found() const { return fd_ >= 0; }
  // Without blocking: the peer closed its end (EOF, a reset, an error). A half-close counts as gone, as
  // nginx counts it: an HTTP/1.1 client waiting for its answer keeps its end open.
  bool gone() const;

 private:
  int fd_ = -1;
};

}  // namespace kda::server
