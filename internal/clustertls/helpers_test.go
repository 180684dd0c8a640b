package clustertls

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"io"
	"net"
	"net/netip"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

const handshakeTimeout = 5 * time.Second

// memberSet is a concurrency-safe Members implementation for tests.
type memberSet struct {
	mu    sync.Mutex
	names map[string]bool
}

func newMemberSet(names ...string) *memberSet {
	s := &memberSet{names: map[string]bool{}}
	for _, n := range names {
		s.names[n] = true
	}
	return s
}

func (s *memberSet) has(name string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.names[name]
}

func (s *memberSet) remove(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.names, name)
}

func mustCA(t testing.TB, name string) *CA {
	t.Helper()
	ca, err := NewCA(name, 24*time.Hour)
	if err != nil {
		t.Fatalf("NewCA: %v", err)
	}
	return ca
}

// installMember issues a certificate for member and writes its files into a
// fresh directory, trusting trustPEM as the cluster CA.
func installMember(t testing.TB, ca *CA, trustPEM []byte, member string, members *memberSet) Config {
	t.Helper()
	certPEM, keyPEM, err := ca.Issue(member, []netip.Addr{netip.MustParseAddr("127.0.0.1")}, time.Hour)
	if err != nil {
		t.Fatalf("Issue(%s): %v", member, err)
	}
	return installPEM(t, trustPEM, member, certPEM, keyPEM, members)
}

func installPEM(t testing.TB, trustPEM []byte, member string, certPEM, keyPEM []byte, members *memberSet) Config {
	t.Helper()
	cfg, err := WriteFiles(filepath.Join(t.TempDir(), member), member, trustPEM, certPEM, keyPEM)
	if err != nil {
		t.Fatalf("WriteFiles(%s): %v", member, err)
	}
	if members != nil {
		cfg.Members = members.has
	}
	return cfg
}

// issueCustom signs an arbitrary leaf with ca, for certificates Issue refuses to make.
func issueCustom(t testing.TB, ca *CA, cn string, dnsNames []string, notBefore, notAfter time.Time) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial, err := randomSerial()
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    notBefore,
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		DNSNames:     dnsNames,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, key.Public(), ca.key)
	if err != nil {
		t.Fatal(err)
	}
	keyPEM, err = encodeKeyPEM(key)
	if err != nil {
		t.Fatal(err)
	}
	return encodeCertPEM(der), keyPEM
}

type serverResult struct {
	peer string
	err  error
}

// startServer accepts connections until the test ends; for each it runs the
// handshake, reports the peer name, and answers "ping" with "pong".
func startServer(t *testing.T, cfg Config) (addr string, results <-chan serverResult) {
	t.Helper()
	ln, err := Listen("127.0.0.1:0", cfg)
	if err != nil {
		t.Fatalf("Listen: %v", err)
	}
	out := make(chan serverResult, 16)
	var wg sync.WaitGroup
	t.Cleanup(func() {
		ln.Close()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				out <- serveOne(c.(*tls.Conn))
			}()
		}
	}()
	return ln.Addr().String(), out
}

func serveOne(conn *tls.Conn) serverResult {
	ctx, cancel := context.WithTimeout(context.Background(), handshakeTimeout)
	defer cancel()
	_ = conn.SetDeadline(time.Now().Add(handshakeTimeout))
	if err := conn.HandshakeContext(ctx); err != nil {
		return serverResult{err: err}
	}
	cs := conn.ConnectionState()
	name, err := PeerName(&cs)
	if err != nil {
		return serverResult{err: err}
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(conn, buf); err != nil {
		return serverResult{err: err}
	}
	if string(buf) != "ping" {
		return serverResult{err: errors.New("bad request " + string(buf))}
	}
	if _, err := conn.Write([]byte("pong")); err != nil {
		return serverResult{err: err}
	}
	return serverResult{peer: name}
}

type clientResult struct {
	peer         string
	serverSerial string
	err          error
}

// clientExchange dials, learns the server's name, and does one ping/pong so
// that a server-side rejection (reported after the TLS 1.3 client handshake)
// surfaces here.
func clientExchange(t *testing.T, addr, expectPeer string, cfg Config) clientResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), handshakeTimeout)
	defer cancel()
	conn, err := Dial(ctx, addr, expectPeer, cfg)
	if err != nil {
		return clientResult{err: err}
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(handshakeTimeout))
	cs := conn.ConnectionState()
	name, err := PeerName(&cs)
	if err != nil {
		return clientResult{err: err}
	}
	if _, err := conn.Write([]byte("ping")); err != nil {
		return clientResult{err: err}
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(conn, buf); err != nil {
		return clientResult{err: err}
	}
	return clientResult{peer: name, serverSerial: cs.PeerCertificates[0].SerialNumber.String()}
}

func recvResult(t *testing.T, ch <-chan serverResult) serverResult {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(2 * handshakeTimeout):
		t.Fatal("server produced no result")
		return serverResult{}
	}
}

// dialRaw connects with a hand-made client config, bypassing Dial's checks.
func dialRaw(addr string, conf *tls.Config) error {
	d := tls.Dialer{NetDialer: &net.Dialer{Timeout: handshakeTimeout}, Config: conf}
	ctx, cancel := context.WithTimeout(context.Background(), handshakeTimeout)
	defer cancel()
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(handshakeTimeout))
	if _, err := c.Write([]byte("ping")); err != nil {
		return err
	}
	_, err = io.ReadFull(c, make([]byte, 4))
	return err
}
