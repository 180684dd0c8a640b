package main

import (
	"os"
	"path/filepath"
	"testing"
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
