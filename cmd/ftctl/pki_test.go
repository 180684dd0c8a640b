package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"

	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/internal/clustertls"
)

// runFtctl runs ftctl in-process and returns its stdout and exit code (as cli.Main would map the error).
func runFtctl(t *testing.T, args ...string) (string, int, error) {
	t.Helper()
	root := newRoot()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs(args)
	root.SilenceUsage, root.SilenceErrors = true, true
	// As cli.Main does: a bad flag value is a usage error.
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &cli.ExitError{Code: cli.ExitUsage, Err: err} })
	err := root.Execute()
	code := cli.ExitOK
	if err != nil {
		code = cli.ExitFailure
		if ee, ok := errors.AsType[*cli.ExitError](err); ok {
			code = ee.Code
		}
	}
	return out.String(), code, err
}

func TestParseValidity(t *testing.T) {
	tests := []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"365d", 365 * 24 * time.Hour, true},
		{"1d", 24 * time.Hour, true},
		{"8760h", 8760 * time.Hour, true},
		{"90m", 90 * time.Minute, true},
		{"0d", 0, false},
		{"-1d", 0, false},
		{"-5h", 0, false},
		{"d", 0, false},
		{"1.5d", 0, false},
		{"year", 0, false},
		{"", 0, false},
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			got, err := parseValidity(tc.in)
			if (err == nil) != tc.ok || got != tc.want {
				t.Errorf("parseValidity(%q) = %v, %v; want %v, ok=%v", tc.in, got, err, tc.want, tc.ok)
			}
		})
	}
}

func mode(t *testing.T, path string) os.FileMode {
	t.Helper()
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Mode()
}

func TestPKIInit(t *testing.T) {
	t.Run("creates a private CA and refuses to overwrite it", func(t *testing.T) {
		dir := filepath.Join(t.TempDir(), "ca")
		if out, code, err := runFtctl(t, "pki", "init", "--dir", dir, "--name", "prod", "--validity", "30d"); code != 0 {
			t.Fatalf("pki init: exit %d: %v\n%s", code, err, out)
		}
		if m := mode(t, dir); m.Perm() != 0o700 || !m.IsDir() {
			t.Errorf("CA dir mode %v, want drwx------", m)
		}
		if m := mode(t, filepath.Join(dir, caKeyName)); m.Perm() != 0o600 {
			t.Errorf("CA key mode %v, want 0600", m)
		}
		if m := mode(t, filepath.Join(dir, caCertName)); m.Perm() != 0o644 {
			t.Errorf("CA cert mode %v, want 0644", m)
		}
		certPEM, _ := os.ReadFile(filepath.Join(dir, caCertName))
		blk, _ := pem.Decode(certPEM)
		cert, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		if cert.Subject.CommonName != "prod" || !cert.IsCA || cert.NotAfter.After(time.Now().Add(31*24*time.Hour)) {
			t.Errorf("CA cert CN %q IsCA %v NotAfter %v; want prod, a CA, valid 30 days", cert.Subject.CommonName, cert.IsCA, cert.NotAfter)
		}
		_, code, err := runFtctl(t, "pki", "init", "--dir", dir)
		if code != cli.ExitUnavailable || err == nil || !strings.Contains(err.Error(), "--force") {
			t.Errorf("second pki init: exit %d, %v; want exit 4 naming --force", code, err)
		}
		after, _ := os.ReadFile(filepath.Join(dir, caCertName))
		if !bytes.Equal(after, certPEM) {
			t.Error("refused pki init changed the CA certificate")
		}
		if _, code, err := runFtctl(t, "pki", "init", "--dir", dir, "--force"); code != 0 {
			t.Fatalf("pki init --force: exit %d: %v", code, err)
		}
		after, _ = os.ReadFile(filepath.Join(dir, caCertName))
		if bytes.Equal(after, certPEM) {
			t.Error("pki init --force kept the old CA")
		}
	})
	tests := []struct {
		name  string
		setup func(t *testing.T, dir string) // dir does not exist yet
		args  []string
		code  int
		want  string
	}{
		{"dir is a symlink", func(t *testing.T, dir string) {
			real := t.TempDir()
			os.Chmod(real, 0o700)
			if err := os.Symlink(real, dir); err != nil {
				t.Fatal(err)
			}
		}, nil, cli.ExitFailure, "symbolic link"},
		{"dir open to others", func(t *testing.T, dir string) { os.Mkdir(dir, 0o755) }, nil, cli.ExitFailure, "chmod 700"},
		{"key is a symlink", func(t *testing.T, dir string) {
			os.Mkdir(dir, 0o700)
			os.Symlink("/etc/passwd", filepath.Join(dir, caKeyName))
		}, []string{"--force"}, cli.ExitFailure, "not a regular file"},
		{"bad validity", nil, []string{"--validity", "0d"}, cli.ExitUsage, "positive"},
		{"empty name", nil, []string{"--name", " "}, cli.ExitUsage, "--name"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "ca")
			if tc.setup != nil {
				tc.setup(t, dir)
			}
			_, code, err := runFtctl(t, append([]string{"pki", "init", "--dir", dir}, tc.args...)...)
			if code != tc.code || err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("exit %d, %v; want exit %d and an error containing %q", code, err, tc.code, tc.want)
			}
			if target, err := os.Readlink(filepath.Join(dir, caKeyName)); err == nil && target != "/etc/passwd" {
				t.Errorf("key link was replaced by %q", target)
			}
		})
	}
}

// pkiCluster creates a CA and issues member certificates with ftctl, returning the CA directory.
func pkiCluster(t *testing.T, hosts ...string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "pki")
	if _, code, err := runFtctl(t, "pki", "init", "--dir", dir); code != 0 {
		t.Fatalf("pki init: %v", err)
	}
	for _, h := range hosts {
		if out, code, err := runFtctl(t, "pki", "issue", "--dir", dir, h, "--address", "127.0.0.1", "--validity", "10d"); code != 0 {
			t.Fatalf("pki issue %s: exit %d: %v\n%s", h, code, err, out)
		}
	}
	return dir
}

func memberTLS(dir, host string, members ...string) clustertls.Config {
	d := filepath.Join(dir, host)
	return clustertls.Config{
		CAFile: filepath.Join(d, caCertName), CertFile: filepath.Join(d, host+".crt"), KeyFile: filepath.Join(d, host+".key"),
		Members: func(n string) bool {
			for _, m := range members {
				if m == n {
					return true
				}
			}
			return false
		},
	}
}

// exchange dials server at addr as client expecting expectPeer, and returns the name the server saw (or
// the error of either side).
func exchange(t *testing.T, server, client clustertls.Config, expectPeer string) (string, error) {
	t.Helper()
	ln, err := clustertls.Listen("127.0.0.1:0", server)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	type res struct {
		name string
		err  error
	}
	got := make(chan res, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			got <- res{err: err}
			return
		}
		defer c.Close()
		tc := c.(*tls.Conn)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := tc.HandshakeContext(ctx); err != nil {
			got <- res{err: err}
			return
		}
		cs := tc.ConnectionState()
		name, err := clustertls.PeerName(&cs)
		if err == nil {
			_, err = tc.Write([]byte("ok"))
		}
		got <- res{name, err}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := clustertls.Dial(ctx, ln.Addr().String(), expectPeer, client)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(30 * time.Second))
	buf := make([]byte, 2)
	_, readErr := conn.Read(buf)
	r := <-got
	if r.err != nil {
		return "", r.err
	}
	return r.name, readErr
}

func TestPKIIssueMakesWorkingMembers(t *testing.T) {
	dir := pkiCluster(t, "node1", "node2")
	for _, f := range []struct {
		path string
		perm os.FileMode
	}{
		{filepath.Join(dir, "node1"), 0o700 | os.ModeDir},
		{filepath.Join(dir, "node1", "node1.key"), 0o600},
		{filepath.Join(dir, "node1", "node1.crt"), 0o644},
		{filepath.Join(dir, "node1", caCertName), 0o644},
	} {
		if m := mode(t, f.path); m != f.perm {
			t.Errorf("%s: mode %v, want %v", f.path, m, f.perm)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "node1", caKeyName)); err == nil {
		t.Error("the CA key was copied into a member's directory")
	}
	n1, n2 := memberTLS(dir, "node1", "node1", "node2"), memberTLS(dir, "node2", "node1", "node2")
	name, err := exchange(t, n1, n2, "node1")
	if err != nil || name != "node2" {
		t.Fatalf("node2 -> node1: server saw %q, %v; want node2, nil", name, err)
	}
	// A certificate for node2 is refused by a client that expects node1 there.
	if _, err := exchange(t, n2, n1, "node1"); err == nil {
		t.Fatal("node1 accepted node2's certificate as node1")
	}
	// An operator certificate is refused by an agent even when its name is a member's.
	if out, code, err := runFtctl(t, "pki", "issue", "--dir", dir, "--operator", "node2", "--out", filepath.Join(dir, "op")); code != 0 {
		t.Fatalf("pki issue --operator: %v\n%s", err, out)
	}
	op := clustertls.Config{CAFile: filepath.Join(dir, "op", caCertName), CertFile: filepath.Join(dir, "op", "operator-node2.crt"),
		KeyFile: filepath.Join(dir, "op", "operator-node2.key")}
	if name, err := exchange(t, n1, op, "node1"); err == nil {
		t.Fatalf("an agent accepted an operator certificate as member %q", name)
	}
}

func TestPKIIssueErrors(t *testing.T) {
	dir := pkiCluster(t)
	link := filepath.Join(t.TempDir(), "out")
	os.Mkdir(link+".real", 0o700)
	os.Symlink(link+".real", link)
	tests := []struct {
		name string
		args []string
		code int
		want string
	}{
		{"IP as host name", []string{"10.0.0.1"}, cli.ExitUsage, "IP address"},
		{"upper case", []string{"Node1"}, cli.ExitUsage, "a-z"},
		{"bad address", []string{"node1", "--address", "node1.example"}, cli.ExitUsage, "IP address"},
		{"outlives the CA", []string{"node1", "--validity", "36500d"}, cli.ExitFailure, "after the CA"},
		{"no CA", []string{"node1", "--dir", t.TempDir()}, cli.ExitFailure, "pki init"},
		{"out is a symlink", []string{"node1", "--out", link}, cli.ExitFailure, "symbolic link"},
		{"operator with address", []string{"--operator", "alice", "--address", "10.0.0.1"}, cli.ExitUsage, "operator"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, code, err := runFtctl(t, append([]string{"pki", "issue", "--dir", dir}, tc.args...)...)
			if code != tc.code || err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("exit %d, %v; want exit %d and an error containing %q", code, err, tc.code, tc.want)
			}
		})
	}
	if entries, _ := os.ReadDir(link + ".real"); len(entries) != 0 {
		t.Errorf("files written through a symlinked --out: %v", entries)
	}
}

// TestPKIRevoke: `pki revoke` lists a member's certificate (by file) and another (by serial) in the CA's
// revocation list, keeps the list across calls, and an agent configured with the list refuses the revoked
// member at its next handshake while the others still connect.
func TestPKIRevoke(t *testing.T) {
	dir := pkiCluster(t, "node1", "node2", "node3")
	crl := filepath.Join(dir, crlName)
	n1 := memberTLS(dir, "node1", "node1", "node2", "node3")
	n1.CRLFile = crl
	if out, code, err := runFtctl(t, "pki", "revoke", "--dir", dir, "--serial", "0A:0b"); code != 0 {
		t.Fatalf("pki revoke --serial: exit %d: %v\n%s", code, err, out)
	}
	if m := mode(t, crl); m != 0o644 {
		t.Errorf("revocation list mode %v, want 0644", m)
	}
	if name, err := exchange(t, n1, memberTLS(dir, "node2", "node1"), "node1"); err != nil || name != "node2" {
		t.Fatalf("node2 before its revocation: %q, %v", name, err)
	}
	out, code, err := runFtctl(t, "pki", "revoke", "--dir", dir, filepath.Join(dir, "node2", "node2.crt"))
	if code != 0 {
		t.Fatalf("pki revoke node2.crt: exit %d: %v\n%s", code, err, out)
	}
	b, _ := os.ReadFile(crl)
	blk, _ := pem.Decode(b)
	rl, err := x509.ParseRevocationList(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	node2PEM, _ := os.ReadFile(filepath.Join(dir, "node2", "node2.crt"))
	cblk, _ := pem.Decode(node2PEM)
	node2, _ := x509.ParseCertificate(cblk.Bytes)
	var serials []string
	for _, e := range rl.RevokedCertificateEntries {
		serials = append(serials, e.SerialNumber.Text(16))
	}
	if len(serials) != 2 || serials[0] != "a0b" || serials[1] != node2.SerialNumber.Text(16) || rl.Number.Int64() != 2 {
		t.Errorf("list #%v holds %v; want #2 with a0b and node2's %x", rl.Number, serials, node2.SerialNumber)
	}
	if name, err := exchange(t, n1, memberTLS(dir, "node2", "node1"), "node1"); err == nil {
		t.Errorf("an agent with the list admitted revoked node2 (as %q)", name)
	}
	if name, err := exchange(t, n1, memberTLS(dir, "node3", "node1"), "node1"); err != nil || name != "node3" {
		t.Errorf("node3, not revoked: %q, %v", name, err)
	}
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"nothing named", nil, "name the certificates"},
		{"bad serial", []string{"--serial", "xyz"}, "hexadecimal"},
		{"zero serial", []string{"--serial", "0"}, "hexadecimal"},
		{"not a certificate", []string{filepath.Join(dir, "node3", "node3.key")}, "not a PEM certificate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, code, err := runFtctl(t, append([]string{"pki", "revoke", "--dir", dir}, tc.args...)...)
			if code != cli.ExitUsage || err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("exit %d, %v; want exit %d and an error containing %q", code, err, cli.ExitUsage, tc.want)
			}
		})
	}
}

// TestPKIIssueKeepsAnotherIdentitysFiles: an operator's files (DIR/operator-NAME/operator-NAME.*) and those
// of a member named operator-NAME are the same paths; issuing one must not silently replace the other's
// certificate and key (a member's credential handed out as an operator's, or the reverse). Renewing the
// same identity still replaces its files.
func TestPKIIssueKeepsAnotherIdentitysFiles(t *testing.T) {
	dir := pkiCluster(t)
	if out, code, err := runFtctl(t, "pki", "issue", "--dir", dir, "--operator", "alice"); code != 0 {
		t.Fatalf("pki issue --operator alice: %v\n%s", err, out)
	}
	crt := filepath.Join(dir, "operator-alice", "operator-alice.crt")
	before, err := os.ReadFile(crt)
	if err != nil {
		t.Fatal(err)
	}
	if _, code, err := runFtctl(t, "pki", "issue", "--dir", dir, "operator-alice"); code == 0 {
		t.Errorf("a member operator-alice was issued over operator alice's files")
	} else if !strings.Contains(err.Error(), "operator:alice") {
		t.Errorf("refusal %v does not name the certificate it keeps", err)
	}
	if after, _ := os.ReadFile(crt); !bytes.Equal(after, before) {
		t.Error("operator alice's certificate was replaced by a member's")
	}
	// Renewal of the same operator replaces its files.
	if out, code, err := runFtctl(t, "pki", "issue", "--dir", dir, "--operator", "alice"); code != 0 {
		t.Fatalf("renew operator alice: %v\n%s", err, out)
	}
	if after, _ := os.ReadFile(crt); bytes.Equal(after, before) {
		t.Error("renewing operator alice kept the old certificate")
	}
	// And the reverse: an operator is not issued over a member's files.
	if out, code, err := runFtctl(t, "pki", "issue", "--dir", dir, "operator-bob"); code != 0 {
		t.Fatalf("pki issue operator-bob: %v\n%s", err, out)
	}
	if _, code, _ := runFtctl(t, "pki", "issue", "--dir", dir, "--operator", "bob"); code == 0 {
		t.Error("operator bob was issued over member operator-bob's files")
	}
}
