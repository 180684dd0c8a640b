package clusterapi

import (
	"bufio"
	"context"
	"net/http"
	"strings"
	"testing"
)

// TestUpgradeBoundsTheResponseHeader: a member answering a snapshot transfer (or a fetch, a determinant
// stream) sends its 101 response headers; the client reads at most a header's worth of them, as the
// transport bounds every other response (MaxResponseHeaderBytes), instead of buffering whatever the peer
// sends until the message timeout.
func TestUpgradeBoundsTheResponseHeader(t *testing.T) {
	const sent = 8 << 20
	pki := newTestPKI(t)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: " + upgradeProto + "\r\n")
		pad := "X-Pad: " + strings.Repeat("a", 1000) + "\r\n"
		for n := 0; n < sent; n += len(pad) {
			if _, err := brw.WriteString(pad); err != nil {
				return
			}
		}
		brw.WriteString("\r\n")
		brw.Flush()
		bufio.NewReader(c).ReadByte() // until the client closes
	})
	addr := serveHandler(t, pki, "n2", h, "n1")
	c := clientOf(t, pki, "n1", map[string]string{"n2": addr}, testTimeouts)
	conn, err := c.Ship(context.Background(), "n2")
	if err == nil {
		conn.Close()
		t.Fatalf("Ship accepted a 101 response with %d MiB of headers", sent>>20)
	}
	t.Logf("refused: %v", err)
}
