package clustertls

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// chainCA makes a CA that NewCA does not: a root that may sign sub-CAs (parent nil), or a sub-CA of parent,
// as a site's own PKI has them (Config.CertFile may carry intermediates).
func chainCA(t *testing.T, name string, parent *CA) *CA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial, err := randomSerial()
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             now.Add(-clockSkew),
		NotAfter:              now.Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLen:            1,
	}
	signer, signerKey := tmpl, key
	if parent != nil {
		tmpl.MaxPathLen, tmpl.MaxPathLenZero = 0, true
		tmpl.NotAfter = now.Add(12 * time.Hour)
		signer, signerKey = parent.cert, parent.key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, signer, key.Public(), signerKey)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	keyPEM, err := encodeKeyPEM(key)
	if err != nil {
		t.Fatal(err)
	}
	return &CA{cert: cert, key: key, certPEM: encodeCertPEM(der), keyPEM: keyPEM}
}

// TestRevokedIntermediateRefused: the root's list revoking a sub-CA refuses every certificate the sub-CA
// issued (its chain holds a revoked certificate), at the server, at the client and in CheckMember, and
// leaves the root's own members admitted. Only the leaf was checked: a revoked sub-CA's members were
// admitted.
func TestRevokedIntermediateRefused(t *testing.T) {
	root := chainCA(t, "site-root", nil)
	sub := chainCA(t, "site-sub", root)
	members := newMemberSet("node1", "node2", "node3")
	crl := filepath.Join(t.TempDir(), "cluster_ca.crl")
	list, err := root.Revoke(nil, []*big.Int{sub.cert.SerialNumber}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(crl, list, 0o644); err != nil {
		t.Fatal(err)
	}
	subMember := func(name string) Config {
		certPEM, keyPEM, err := sub.Issue(name, nil, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		cfg := installPEM(t, root.CertPEM(), name, append(certPEM, sub.CertPEM()...), keyPEM, members)
		cfg.CRLFile = crl
		return cfg
	}
	node1 := installMember(t, root, root.CertPEM(), "node1", members)
	node1.CRLFile = crl
	node2, node3 := subMember("node2"), subMember("node3")
	node3.CRLFile = "" // accepted without the list: the refusals below are the list's

	addr, _ := startServer(t, node1)
	if r := clientExchange(t, addr, "node1", node3); r.err == nil || !strings.Contains(r.err.Error(), "revoked") && !strings.Contains(r.err.Error(), "remote error") {
		t.Errorf("node3 of the revoked sub-CA dialling node1: %v; want a refusal", r.err)
	}
	addr2, _ := startServer(t, node3)
	if r := clientExchange(t, addr2, "node3", node1); r.err == nil || !strings.Contains(r.err.Error(), "revoked") {
		t.Errorf("node1 dialling node3 of the revoked sub-CA: %v; want a revocation error", r.err)
	}
	var crlCheck error
	for _, c := range node2.CheckMember("node2", time.Now()) {
		if strings.HasPrefix(c.What, "CRL file") {
			crlCheck = c.Err
		}
	}
	if crlCheck == nil || !strings.Contains(crlCheck.Error(), "revoked") {
		t.Errorf("CheckMember of node2, of the revoked sub-CA: CRL check %v; want a revocation error", crlCheck)
	}

	// The root's own members are not affected.
	node4 := installMember(t, root, root.CertPEM(), "node3", members)
	node4.CRLFile = crl
	if r := clientExchange(t, addr, "node1", node4); r.err != nil {
		t.Errorf("node3 of the root dialling node1: %v", r.err)
	}
}
