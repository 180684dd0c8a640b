package clustertls

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/x509"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestValidateMemberName(t *testing.T) {
	tests := []struct {
		name string
		ok   bool
	}{
		{"node1", true},
		{"rack-2.node-14", true},
		{"a", true},
		{strings.Repeat("a", 63), true},
		{strings.Repeat("a", 31) + "." + strings.Repeat("b", 32), true},
		{"", false},
		{strings.Repeat("a", 64), false},
		{strings.Repeat("a", 31) + "." + strings.Repeat("b", 33), false},
		{"Node1", false},
		{"node_1", false},
		{"-node", false},
		{"node-", false},
		{"a..b", false},
		{".node", false},
		{"../etc", false},
		{"node/1", false},
		{"10.0.0.1", false},
		{"::1", false},
		{"cluster_ca", false}, // would collide with the CA file names
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := ValidateMemberName(tc.name)
			if (err == nil) != tc.ok {
				t.Errorf("ValidateMemberName(%q) = %v, want ok=%v", tc.name, err, tc.ok)
			}
		})
	}
}

func TestIssueProducesMemberCertificate(t *testing.T) {
	ca := mustCA(t, "cluster")
	ips := []netip.Addr{netip.MustParseAddr("10.1.0.7"), netip.MustParseAddr("::ffff:10.1.0.8"), netip.MustParseAddr("fd00::7")}
	before := time.Now()
	certPEM, keyPEM, err := ca.Issue("node7", ips, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	certs, err := parseCertsPEM(certPEM)
	if err != nil {
		t.Fatal(err)
	}
	leaf := certs[0]
	if leaf.Subject.CommonName != "node7" || !slices.Equal(leaf.DNSNames, []string{"node7"}) {
		t.Errorf("CN=%q DNS=%v, want node7 in both", leaf.Subject.CommonName, leaf.DNSNames)
	}
	var gotIPs []string
	for _, ip := range leaf.IPAddresses {
		gotIPs = append(gotIPs, ip.String())
	}
	if want := []string{"10.1.0.7", "10.1.0.8", "fd00::7"}; !slices.Equal(gotIPs, want) {
		t.Errorf("IP SANs = %v, want %v", gotIPs, want)
	}
	if !slices.Contains(leaf.ExtKeyUsage, x509.ExtKeyUsageServerAuth) || !slices.Contains(leaf.ExtKeyUsage, x509.ExtKeyUsageClientAuth) {
		t.Errorf("EKU = %v, want server and client auth", leaf.ExtKeyUsage)
	}
	if leaf.NotBefore.After(before) || leaf.NotAfter.Before(before.Add(time.Hour-time.Second)) || leaf.NotAfter.After(time.Now().Add(time.Hour)) {
		t.Errorf("validity %v..%v, want from before now to now+1h", leaf.NotBefore, leaf.NotAfter)
	}
	if leaf.IsCA {
		t.Error("member certificate is a CA")
	}
	pub, ok := leaf.PublicKey.(*ecdsa.PublicKey)
	if !ok || pub.Curve != elliptic.P256() {
		t.Errorf("public key %T, want ECDSA P-256", leaf.PublicKey)
	}
	key, err := parseKeyPEM(keyPEM)
	if err != nil || !publicKeysMatch(key, leaf.PublicKey) {
		t.Fatalf("key PEM does not match certificate: %v", err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca.CertPEM())
	for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth} {
		if _, err := leaf.Verify(x509.VerifyOptions{Roots: pool, DNSName: "node7", KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
			t.Errorf("verify for usage %v: %v", usage, err)
		}
	}
}

func TestIssueRejects(t *testing.T) {
	ca := mustCA(t, "cluster")
	tests := []struct {
		name     string
		member   string
		ips      []netip.Addr
		validity time.Duration
		want     string
	}{
		{"bad name", "Node 1", nil, time.Hour, "may only contain"},
		{"IP as name", "192.168.0.1", nil, time.Hour, "is an IP address"},
		{"zero IP", "node1", []netip.Addr{{}}, time.Hour, "invalid (zero) IP"},
		{"non-positive validity", "node1", nil, 0, "must be positive"},
		{"outlives CA", "node1", nil, 48 * time.Hour, "after the CA does"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := ca.Issue(tc.member, tc.ips, tc.validity)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Issue err = %v, want it to contain %q", err, tc.want)
			}
		})
	}
}

func TestLoadCARoundTrip(t *testing.T) {
	ca := mustCA(t, "cluster")
	loaded, err := LoadCA(ca.CertPEM(), ca.KeyPEM())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(loaded.CertPEM(), ca.CertPEM()) || !bytes.Equal(loaded.KeyPEM(), ca.KeyPEM()) {
		t.Fatal("loaded CA differs from the original")
	}
	// A certificate issued by the reloaded CA verifies against the original root.
	certPEM, _, err := loaded.Issue("node1", nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	certs, err := parseCertsPEM(certPEM)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca.CertPEM())
	if _, err := certs[0].Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Fatalf("certificate from reloaded CA does not verify: %v", err)
	}
}

func TestLoadCARejects(t *testing.T) {
	ca := mustCA(t, "cluster")
	other := mustCA(t, "other")
	leafPEM, leafKey, err := ca.Issue("node1", nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name      string
		cert, key []byte
		want      string
	}{
		{"key of another CA", ca.CertPEM(), other.KeyPEM(), "key does not belong"},
		{"member certificate", leafPEM, leafKey, "is not a CA certificate"},
		{"two certificates", append(ca.CertPEM(), other.CertPEM()...), ca.KeyPEM(), "expected exactly 1"},
		{"garbage certificate", []byte("hello"), ca.KeyPEM(), "no PEM CERTIFICATE block"},
		{"garbage key", ca.CertPEM(), []byte("hello"), "no PEM private key block"},
		{"encrypted key", ca.CertPEM(), []byte("-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n-----END ENCRYPTED PRIVATE KEY-----\n"), "encrypted private keys are not supported"},
		{"two keys", ca.CertPEM(), append(ca.KeyPEM(), other.KeyPEM()...), "more than one PEM block"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := LoadCA(tc.cert, tc.key)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("LoadCA err = %v, want it to contain %q", err, tc.want)
			}
		})
	}
}

func TestNewCARejects(t *testing.T) {
	tests := []struct {
		name     string
		caName   string
		validity time.Duration
	}{
		{"empty name", " ", time.Hour},
		{"zero validity", "cluster", 0},
		{"negative validity", "cluster", -time.Hour},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := NewCA(tc.caName, tc.validity); err == nil {
				t.Errorf("NewCA(%q, %v) succeeded", tc.caName, tc.validity)
			}
		})
	}
}

func TestWriteFilesModesAndAtomicity(t *testing.T) {
	ca := mustCA(t, "cluster")
	dir := filepath.Join(t.TempDir(), "pki")
	if err := WriteCA(dir, ca); err != nil {
		t.Fatal(err)
	}
	certPEM, keyPEM, err := ca.Issue("node1", nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	// Write twice: the second write must replace, not append or fail.
	for range 2 {
		if _, err := WriteFiles(dir, "node1", ca.CertPEM(), certPEM, keyPEM); err != nil {
			t.Fatal(err)
		}
	}
	cfg, err := WriteFiles(dir, "node1", ca.CertPEM(), certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		path string
		data []byte
		mode os.FileMode
	}{
		{filepath.Join(dir, caCertFile), ca.CertPEM(), 0o644},
		{filepath.Join(dir, caKeyFile), ca.KeyPEM(), 0o600},
		{cfg.CertFile, certPEM, 0o644},
		{cfg.KeyFile, keyPEM, 0o600},
	}
	for _, tc := range tests {
		st, err := os.Stat(tc.path)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != tc.mode {
			t.Errorf("%s mode %v, want %v", tc.path, st.Mode().Perm(), tc.mode)
		}
		got, err := os.ReadFile(tc.path)
		if err != nil || !bytes.Equal(got, tc.data) {
			t.Errorf("%s content differs (err %v)", tc.path, err)
		}
	}
	if st, err := os.Stat(dir); err != nil || st.Mode().Perm() != 0o700 {
		t.Errorf("dir mode %v (err %v), want 0700", st.Mode().Perm(), err)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 4 {
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Errorf("dir holds %v, want exactly the 4 credential files (temp files left behind?)", names)
	}
	// The written CA loads back, and a bad member name writes nothing.
	if _, err := LoadCA(ca.CertPEM(), mustRead(t, filepath.Join(dir, caKeyFile))); err != nil {
		t.Errorf("written CA key does not load: %v", err)
	}
	if _, err := WriteFiles(dir, "../evil", ca.CertPEM(), certPEM, keyPEM); err == nil {
		t.Error("WriteFiles accepted member name ../evil")
	}
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
