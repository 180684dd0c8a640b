package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/internal/cli"
)

// TestPKIRevokeOtherCAsCertificate: during a CA rotation the members trust the old and the new CA
// (docs: both in the CA file). `pki revoke --dir NEW` of a certificate the OLD CA issued cannot take
// effect (a CRL revokes only its own CA's certificates); it must refuse rather than report the serial
// revoked while the certificate is still admitted.
func TestPKIRevokeOtherCAsCertificate(t *testing.T) {
	oldDir := pkiCluster(t, "node1", "node2")
	newDir := filepath.Join(t.TempDir(), "pki-2")
	if _, code, err := runFtctl(t, "pki", "init", "--dir", newDir, "--name", "ftkit-cluster-2"); code != 0 {
		t.Fatalf("pki init: %v", err)
	}
	// node1 trusts both CAs, as in a rotation, and reads the new CA's revocation list.
	oldCA, _ := os.ReadFile(filepath.Join(oldDir, caCertName))
	newCA, _ := os.ReadFile(filepath.Join(newDir, caCertName))
	both := filepath.Join(t.TempDir(), "both.crt")
	if err := os.WriteFile(both, append(append([]byte(nil), oldCA...), newCA...), 0o644); err != nil {
		t.Fatal(err)
	}
	n1 := memberTLS(oldDir, "node1", "node1", "node2")
	n1.CAFile = both
	n1.CRLFile = filepath.Join(newDir, crlName)

	out, code, err := runFtctl(t, "pki", "revoke", "--dir", newDir, filepath.Join(oldDir, "node2", "node2.crt"))
	if code != 0 {
		t.Logf("refused (as it should): exit %d: %v", code, err)
		return
	}
	t.Logf("pki revoke said: %s", out)
	name, err := exchange(t, n1, memberTLS(oldDir, "node2", "node1"), "node1")
	t.Logf("exchange: %q, %v", name, err)
	if err == nil {
		t.Errorf("pki revoke reported node2's certificate revoked, but an agent with the list still admits it (as %q)", name)
	}
}

// TestPKIRevokeTheCAItself: a CA's revocation list cannot withdraw the CA (agents check every certificate
// of a chain against the lists but its trust anchor, which only the CA file withdraws). `pki revoke` of
// the CA's own certificate, by file or by serial, must refuse rather than report it revoked while every
// certificate it issued is still admitted.
func TestPKIRevokeTheCAItself(t *testing.T) {
	dir := pkiCluster(t, "node1", "node2")
	caPEM, err := os.ReadFile(filepath.Join(dir, caCertName))
	if err != nil {
		t.Fatal(err)
	}
	ca, err := parseCertPEM(caPEM)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"by file", []string{filepath.Join(dir, caCertName)}},
		{"by serial", []string{"--serial", ca.SerialNumber.Text(16)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, code, err := runFtctl(t, append([]string{"pki", "revoke", "--dir", dir}, tc.args...)...)
			if code != cli.ExitUsage || err == nil || !strings.Contains(err.Error(), "CA file") {
				t.Errorf("exit %d, %v (%s); want a refusal saying to take the CA out of the CA files", code, err, out)
			}
			if _, err := os.Stat(filepath.Join(dir, crlName)); err == nil {
				t.Errorf("a revocation list was written")
			}
		})
	}
}
