package clustertls

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestIssueOperator(t *testing.T) {
	ca := mustCA(t, "cluster")
	certPEM, _, err := ca.IssueOperator("alice", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	certs, err := parseCertsPEM(certPEM)
	if err != nil {
		t.Fatal(err)
	}
	c := certs[0]
	if c.Subject.CommonName != "operator:alice" || len(c.DNSNames) != 0 || len(c.IPAddresses) != 0 {
		t.Errorf("CN %q DNS %v IP %v; want operator:alice and no SANs", c.Subject.CommonName, c.DNSNames, c.IPAddresses)
	}
	if len(c.ExtKeyUsage) != 1 || c.ExtKeyUsage[0] != x509.ExtKeyUsageClientAuth {
		t.Errorf("ExtKeyUsage %v, want client auth only", c.ExtKeyUsage)
	}
	if ValidateMemberName(c.Subject.CommonName) == nil {
		t.Error("an operator CN passes as a member name")
	}
	for _, tc := range []struct {
		name     string
		validity time.Duration
		want     string
	}{
		{"Alice", time.Hour, "a-z"},
		{"", time.Hour, "empty"},
		{"alice", 0, "positive"},
		{"alice", 48 * time.Hour, "after the CA"},
	} {
		if _, _, err := ca.IssueOperator(tc.name, tc.validity); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("IssueOperator(%q, %v) = %v, want an error containing %q", tc.name, tc.validity, err, tc.want)
		}
	}
}

// An operator certificate is refused by an agent (as a member), and OperatorName reads it where a
// member's certificate is refused.
func TestOperatorCertificateIsNotAMember(t *testing.T) {
	ca := mustCA(t, "cluster")
	members := newMemberSet("node1", "alice")
	server := installMember(t, ca, ca.CertPEM(), "node1", members)
	certPEM, keyPEM, err := ca.IssueOperator("alice", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	op := installPEM(t, ca.CertPEM(), "alice", certPEM, keyPEM, nil)
	addr, results := startServer(t, server)
	if c := clientExchange(t, addr, "node1", op); c.err == nil {
		t.Error("the operator's exchange with an agent succeeded")
	}
	if r := recvResult(t, results); r.err == nil {
		t.Fatalf("the agent accepted an operator certificate as member %q", r.peer)
	}
	// OperatorName, on verified chains as a server would have them.
	opCert, _ := parseCertsPEM(certPEM)
	memberPEM, _, err := ca.Issue("node2", nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	memberCert, _ := parseCertsPEM(memberPEM)
	if name, err := OperatorName(stateWith(opCert[0])); err != nil || name != "alice" {
		t.Errorf("OperatorName(operator cert) = %q, %v; want alice", name, err)
	}
	if name, err := OperatorName(stateWith(memberCert[0])); err == nil {
		t.Errorf("OperatorName(member cert) = %q, want an error", name)
	}
	if _, err := OperatorName(nil); err == nil {
		t.Error("OperatorName(nil) succeeded")
	}
}

func TestCheckMember(t *testing.T) {
	ca := mustCA(t, "cluster")
	cfg := installMember(t, ca, ca.CertPEM(), "node1", nil)
	failed := func(checks []CredentialCheck) []string {
		var f []string
		for _, c := range checks {
			if c.Err != nil {
				f = append(f, c.What+": "+c.Err.Error())
			}
		}
		return f
	}
	if f := failed(cfg.CheckMember("node1", time.Now())); len(f) != 0 {
		t.Errorf("good credentials failed: %v", f)
	}
	for _, tc := range []struct {
		name   string
		member string
		at     time.Time
		want   string
	}{
		{"other member", "node2", time.Now(), `CN is "node1", not "node2"`},
		{"expired", "node1", time.Now().Add(2 * time.Hour), "expired"},
		{"not yet valid", "node1", time.Now().Add(-time.Hour), "clock"},
	} {
		f := failed(cfg.CheckMember(tc.member, tc.at))
		if len(f) != 1 || !strings.Contains(f[0], tc.want) {
			t.Errorf("%s: failed checks %v, want exactly one saying %q", tc.name, f, tc.want)
		}
	}
	// With a revocation list: the CA's that does not list node1 passes; one that does, or another CA's, fails.
	certPEM, err := os.ReadFile(cfg.CertFile)
	if err != nil {
		t.Fatal(err)
	}
	own := leafOf(t, certPEM).SerialNumber
	for _, tc := range []struct {
		name   string
		ca     *CA
		serial *big.Int
		want   string // "" passes
	}{
		{"list without node1", ca, big.NewInt(5), ""},
		{"list revoking node1", ca, own, "was revoked"},
		{"another CA's list", mustCA(t, "other"), big.NewInt(5), "not signed"},
	} {
		list, err := tc.ca.Revoke(nil, []*big.Int{tc.serial}, time.Now())
		if err != nil {
			t.Fatal(err)
		}
		cfg.CRLFile = filepath.Join(t.TempDir(), "cluster_ca.crl")
		if err := os.WriteFile(cfg.CRLFile, list, 0o644); err != nil {
			t.Fatal(err)
		}
		f := failed(cfg.CheckMember("node1", time.Now()))
		if (tc.want == "" && len(f) != 0) || (tc.want != "" && (len(f) != 1 || !strings.Contains(f[0], tc.want))) {
			t.Errorf("%s: failed checks %v; want %q", tc.name, f, tc.want)
		}
	}
}

func stateWith(leaf *x509.Certificate) *tls.ConnectionState {
	return &tls.ConnectionState{VerifiedChains: [][]*x509.Certificate{{leaf}}}
}

// The server admits an operator only when its Operators check says so; a member's Members check never
// admits one, and the name the server reads is the operator's.
func TestServerAdmitsOperators(t *testing.T) {
	ca := mustCA(t, "cluster")
	certPEM, keyPEM, err := ca.IssueOperator("alice", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	op := installPEM(t, ca.CertPEM(), "alice", certPEM, keyPEM, nil)
	for _, tc := range []struct {
		name      string
		operators func(string) bool
		want      string // "" admitted
	}{
		{"no operator check", nil, "accepts no such operator"},
		{"alice allowed", func(n string) bool { return n == "alice" }, ""},
		{"only bob allowed", func(n string) bool { return n == "bob" }, `operator "alice"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			server := installMember(t, ca, ca.CertPEM(), "node1", newMemberSet("node1", "alice", "operator:alice"))
			server.Operators = tc.operators
			srvTLS, err := server.ServerTLS()
			if err != nil {
				t.Fatal(err)
			}
			cliTLS, err := op.ClientTLS("node1")
			if err != nil {
				t.Fatal(err)
			}
			a, b := net.Pipe()
			defer a.Close()
			defer b.Close()
			ctx, cancel := context.WithTimeout(context.Background(), handshakeTimeout)
			defer cancel()
			go func() {
				// Keep reading: the server's alert (or nothing) must be taken off the synchronous pipe.
				c := tls.Client(b, cliTLS)
				if c.HandshakeContext(ctx) == nil {
					io.Copy(io.Discard, c)
				}
			}()
			srv := tls.Server(a, srvTLS)
			err = srv.HandshakeContext(ctx)
			checkSide(t, "server", err, tc.want)
			if err != nil {
				return
			}
			cs := srv.ConnectionState()
			if name, err := OperatorName(&cs); err != nil || name != "alice" {
				t.Errorf("OperatorName = %q, %v; want alice", name, err)
			}
			if name, err := PeerName(&cs); err == nil {
				t.Errorf("PeerName of an operator = %q, want an error", name)
			}
		})
	}
}
