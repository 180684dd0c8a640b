package clustertls

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
)

// Dial connects to addr over TCP and completes a mutual TLS handshake with
// member expectPeer. With TLS 1.3 the server checks our certificate after the
// client handshake finishes, so a server that refuses us shows up as an error
// on the first Read, not from Dial.
func Dial(ctx context.Context, addr, expectPeer string, cfg Config) (*tls.Conn, error) {
	var d net.Dialer
	raw, err := d.DialContext(ctx, "tcp", addr)
	if err == nil {
		var tc *tls.Conn
		if tc, err = Client(ctx, raw, expectPeer, cfg); err == nil {
			return tc, nil
		}
		raw.Close()
	}
	return nil, fmt.Errorf("dial %s (%s): %w", expectPeer, addr, err)
}

// Client completes a mutual TLS handshake with member expectPeer over conn, a connection the caller
// dialed (Dial's, over a connection of the caller's own).
func Client(ctx context.Context, conn net.Conn, expectPeer string, cfg Config) (*tls.Conn, error) {
	tlsCfg, err := cfg.ClientTLS(expectPeer)
	if err != nil {
		return nil, err
	}
	tc := tls.Client(conn, tlsCfg)
	if err := tc.HandshakeContext(ctx); err != nil {
		return nil, fmt.Errorf("TLS handshake with %s: %w", expectPeer, err)
	}
	return tc, nil
}

// Listen accepts mutual TLS connections from cluster members on addr. The
// handshake runs lazily; call HandshakeContext with a deadline on each
// accepted *tls.Conn before PeerName, so a silent client cannot pin a handler.
func Listen(addr string, cfg Config) (net.Listener, error) {
	tlsCfg, err := cfg.ServerTLS()
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", addr, err)
	}
	ln, err := tls.Listen("tcp", addr, tlsCfg)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", addr, err)
	}
	return ln, nil
}
