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
	tlsCfg, err := cfg.ClientTLS(expectPeer)
	if err != nil {
		return nil, fmt.Errorf("dial %s (%s): %w", expectPeer, addr, err)
	}
	d := tls.Dialer{Config: tlsCfg}
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("dial %s (%s): %w", expectPeer, addr, err)
	}
	return conn.(*tls.Conn), nil
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
