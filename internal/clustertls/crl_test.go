package clustertls

import (
	"crypto/x509"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/internal/atomicfile"
)

func leafOf(t *testing.T, certPEM []byte) *x509.Certificate {
	t.Helper()
	certs, err := parseCertsPEM(certPEM)
	if err != nil || len(certs) != 1 {
		t.Fatalf("parse certificate: %v (%d)", err, len(certs))
	}
	return certs[0]
}

// TestRevokeAccumulates: each Revoke keeps the earlier list's entries (with their first revocation time),
// adds the new serials once, and numbers the list one higher.
func TestRevokeAccumulates(t *testing.T) {
	ca := mustCA(t, "cluster")
	t0 := time.Now().Truncate(time.Second)
	first, err := ca.Revoke(nil, []*big.Int{big.NewInt(7)}, t0)
	if err != nil {
		t.Fatal(err)
	}
	second, err := ca.Revoke(first, []*big.Int{big.NewInt(7), big.NewInt(9)}, t0.Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	lists, err := parseCRLs(second, []*x509.Certificate{ca.cert})
	if err != nil || len(lists) != 1 {
		t.Fatalf("parse: %v (%d lists)", err, len(lists))
	}
	rl := lists[0]
	if rl.Number.Cmp(big.NewInt(2)) != 0 {
		t.Errorf("number %v, want 2", rl.Number)
	}
	got := map[int64]time.Time{}
	for _, e := range rl.RevokedCertificateEntries {
		got[e.SerialNumber.Int64()] = e.RevocationTime
	}
	if len(got) != 2 || !got[7].Equal(t0) || !got[9].Equal(t0.Add(time.Hour)) {
		t.Errorf("entries %v; want 7 at %v and 9 at %v", got, t0, t0.Add(time.Hour))
	}
	if _, err := ca.Revoke(second, nil, t0); err == nil {
		t.Error("Revoke without a serial succeeded")
	}
	if _, err := ca.Revoke(nil, []*big.Int{big.NewInt(0)}, t0); err == nil {
		t.Error("Revoke of serial 0 succeeded")
	}
	other := mustCA(t, "other")
	if _, err := other.Revoke(second, []*big.Int{big.NewInt(1)}, t0); err == nil || !strings.Contains(err.Error(), "not signed") {
		t.Errorf("another CA extending the list: %v; want a signature error", err)
	}
}

// TestParseCRLsRefuses: a list the CA file's CAs did not sign, or a file that is not CRLs, is an error,
// never an empty list.
func TestParseCRLsRefuses(t *testing.T) {
	ca, other := mustCA(t, "cluster"), mustCA(t, "other")
	good, err := ca.Revoke(nil, []*big.Int{big.NewInt(3)}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	foreign, err := other.Revoke(nil, []*big.Int{big.NewInt(3)}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(good)
	flipped := append([]byte(nil), block.Bytes...)
	flipped[len(flipped)-3] ^= 0xff
	for _, tc := range []struct {
		name string
		data []byte
		want string
	}{
		{"empty", nil, "no CRL"},
		{"not PEM", []byte("revoked: 3\n"), "not PEM"},
		{"a certificate", ca.CertPEM(), `"CERTIFICATE"`},
		{"another CA's list", foreign, "not signed"},
		{"good then foreign", append(append([]byte(nil), good...), foreign...), "CRL 2"},
		{"signature broken", pem.EncodeToMemory(&pem.Block{Type: "X509 CRL", Bytes: flipped}), "CRL 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseCRLs(tc.data, []*x509.Certificate{ca.cert})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v; want one containing %q", err, tc.want)
			}
		})
	}
	if lists, err := parseCRLs(good, []*x509.Certificate{other.cert, ca.cert}); err != nil || len(lists) != 1 {
		t.Errorf("a list of the second CA of the file: %v", err)
	}
}

// TestRevokedPeersRefused: with a CRL file, a server refuses a revoked operator and a revoked member at
// the handshake and admits the others; a client refuses a revoked server; writing the file takes effect
// at the next handshake, without a restart; a bad CRL file fails the configuration, closed.
func TestRevokedPeersRefused(t *testing.T) {
	ca := mustCA(t, "cluster")
	members := newMemberSet("node1", "node2", "node3")
	node2Cert, node2Key, err := ca.Issue("node2", nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	aliceCert, aliceKey, err := ca.IssueOperator("alice", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	crl := filepath.Join(t.TempDir(), "cluster_ca.crl")
	server := installMember(t, ca, ca.CertPEM(), "node1", members)
	server.Operators = func(string) bool { return true }
	server.CRLFile = crl
	node2 := installPEM(t, ca.CertPEM(), "node2", node2Cert, node2Key, members)
	node3 := installMember(t, ca, ca.CertPEM(), "node3", members)
	alice := installPEM(t, ca.CertPEM(), "alice", aliceCert, aliceKey, nil)

	list, err := ca.Revoke(nil, []*big.Int{big.NewInt(1)}, time.Now()) // nobody's
	if err != nil {
		t.Fatal(err)
	}
	if err := atomicfile.WriteFile(crl, list, 0o644); err != nil {
		t.Fatal(err)
	}
	addr, _ := startServer(t, server)
	for name, cfg := range map[string]Config{"node2": node2, "node3": node3} {
		if r := clientExchange(t, addr, "node1", cfg); r.err != nil {
			t.Fatalf("%s before any revocation: %v", name, r.err)
		}
	}

	list, err = ca.Revoke(list, []*big.Int{leafOf(t, node2Cert).SerialNumber, leafOf(t, aliceCert).SerialNumber}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if err := atomicfile.WriteFile(crl, list, 0o644); err != nil {
		t.Fatal(err)
	}
	if r := clientExchange(t, addr, "node1", node2); r.err == nil {
		t.Error("revoked member node2 admitted")
	}
	if r := clientExchange(t, addr, "node1", node3); r.err != nil {
		t.Errorf("node3, not revoked, refused: %v", r.err)
	}
	if _, err := alice.ClientTLS("node1"); err != nil {
		t.Fatal(err)
	}
	if r := clientExchange(t, addr, "node1", alice); r.err == nil {
		t.Error("revoked operator alice admitted")
	}

	// A client with the list refuses the revoked node2 as a server.
	node2.Operators = func(string) bool { return true }
	addr2, _ := startServer(t, node2)
	node3.CRLFile = crl
	if r := clientExchange(t, addr2, "node2", node3); r.err == nil || !strings.Contains(r.err.Error(), "revoked") {
		t.Errorf("node3 dialling revoked node2: %v; want a revocation error", r.err)
	}

	// Fail closed: a list from another CA makes the server's configuration fail, naming the file.
	foreign, err := mustCA(t, "other").Revoke(nil, []*big.Int{big.NewInt(1)}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	bad := filepath.Join(t.TempDir(), "foreign.crl")
	if err := os.WriteFile(bad, foreign, 0o644); err != nil {
		t.Fatal(err)
	}
	server.CRLFile = bad
	if _, err := server.ServerTLS(); err == nil || !strings.Contains(err.Error(), bad) {
		t.Errorf("ServerTLS with another CA's list: %v; want an error naming %s", err, bad)
	}
	server.CRLFile = filepath.Join(t.TempDir(), "missing.crl")
	if _, err := server.ServerTLS(); err == nil {
		t.Error("ServerTLS with a missing CRL file succeeded")
	}
}
