// ClientConnection (src/kda/server/connection.h): it finds the accepted socket of an address pair among
// the process's descriptors, and tells a client that closed, reset or half-closed its end from one that
// waits or sent bytes ahead.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>

#include "kda/server/connection.h"

namespace {

using kda::server::ClientConnection;

int port_of(int fd, bool peer) {
  sockaddr_in a{};
  socklen_t len = sizeof a;
  const int rc = peer ? getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len)
                      : getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  return rc == 0 ? ntohs(a.sin_port) : -1;
}

// A loopback connection: the listening socket, the client's end and the accepted (server's) end.
struct Loopback {
  int listener = -1, client = -1, accepted = -1;
  Loopback() {
    listener = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    EXPECT_EQ(listen(listener, 4), 0);
    a.sin_port = htons(static_cast<uint16_t>(port_of(listener, false)));
    client = socket(AF_INET, SOCK_STREAM, 0);
    EXPECT_EQ(connect(client, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    accepted = accept(listener, nullptr, nullptr);
    EXPECT_GE(accepted, 0);
  }
  ~Loopback() {
    for (int fd : {listener, client, accepted})
      if (fd >= 0) close(fd);
  }
  // As the server sees it: its local port, the client's port.
  ClientConnection connection() const {
    return ClientConnection("127.0.0.1", port_of(accepted, false), "127.0.0.1", port_of(accepted, true));
  }
};

// gone() after the peer's FIN or RST reaches the socket (loopback: at once, but not synchronously).
bool becomes_gone(const ClientConnection& c) {
  for (int i = 0; i < 200; ++i) {
    if (c.gone()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

TEST(ClientConnection, FindsTheAcceptedSocketAndSeesAClose) {
  Loopback l;
  const ClientConnection c = l.connection();
  ASSERT_TRUE(c.found());
  EXPECT_FALSE(c.gone());
  close(l.client);
  l.client = -1;
  EXPECT_TRUE(becomes_gone(c));
}

TEST(ClientConnection, BytesSentAheadAreNotAClose) {
  Loopback l;
  const ClientConnection c = l.connection();
  ASSERT_TRUE(c.found());
  ASSERT_EQ(send(l.client, "GET / HTTP/1.1\r\n", 16, 0), 16);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(c.gone());
  char buf[16];
  EXPECT_EQ(recv(l.accepted, buf, sizeof buf, MSG_DONTWAIT), 16);  // gone() only peeked
}

TEST(ClientConnection, AResetAndAHalfCloseAreGone) {
  Loopback reset;
  const ClientConnection r = reset.connection();
  ASSERT_TRUE(r.found());
  linger lg{1, 0};  // close with RST
  ASSERT_EQ(setsockopt(reset.client, SOL_SOCKET, SO_LINGER, &lg, sizeof lg), 0);
  close(reset.client);
  reset.client = -1;
  EXPECT_TRUE(becomes_gone(r));

  Loopback half;
  const ClientConnection h = half.connection();
  ASSERT_TRUE(h.found());
  ASSERT_EQ(shutdown(half.client, SHUT_WR), 0);
  EXPECT_TRUE(becomes_gone(h));
}

TEST(ClientConnection, AnUnknownPairIsNotFoundAndNeverGone) {
  Loopback l;
  // The client's own end has the pair reversed; the listener has no peer.
  const ClientConnection reversed("127.0.0.1", port_of(l.accepted, true), "127.0.0.1", 1);
  EXPECT_FALSE(reversed.found());
  EXPECT_FALSE(reversed.gone());
  const ClientConnection wrong_host("127.0.0.2", port_of(l.accepted, false), "127.0.0.1",
                                    port_of(l.accepted, true));
  EXPECT_FALSE(wrong_host.found());
  const ClientConnection no_port("127.0.0.1", -1, "127.0.0.1", -1);
  EXPECT_FALSE(no_port.found());
}

}  // namespace
