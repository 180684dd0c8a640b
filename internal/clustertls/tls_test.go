package clustertls

import (
	"crypto/tls"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/internal/atomicfile"
)

func TestHandshake(t *testing.T) {
	ca := mustCA(t, "cluster")
	foreign := mustCA(t, "intruder")
	trust := ca.CertPEM()
	now := time.Now()

	goodServer := func(t *testing.T, m *memberSet) Config { return installMember(t, ca, trust, "node1", m) }
	tests := []struct {
		name       string
		server     func(t *testing.T, m *memberSet) Config
		client     func(t *testing.T) Config
		expectPeer string
		// Empty substrings mean that side must succeed.
		serverErr, clientErr string
	}{
		{
			name:       "two members learn each other's names",
			server:     goodServer,
			client:     func(t *testing.T) Config { return installMember(t, ca, trust, "node2", nil) },
			expectPeer: "node1",
		},
		{
			name:       "client certificate from another CA",
			server:     goodServer,
			client:     func(t *testing.T) Config { return installMember(t, foreign, trust, "node2", nil) },
			expectPeer: "node1",
			serverErr:  "unknown authority",
			clientErr:  "unknown certificate authority",
		},
		{
			name:       "client CN is not a member",
			server:     goodServer,
			client:     func(t *testing.T) Config { return installMember(t, ca, trust, "node3", nil) },
			expectPeer: "node1",
			serverErr:  `peer "node3" has a valid cluster certificate but is not a cluster member`,
			clientErr:  "remote error",
		},
		{
			name:       "server is a different member than expected",
			server:     goodServer,
			client:     func(t *testing.T) Config { return installMember(t, ca, trust, "node2", nil) },
			expectPeer: "node2",
			serverErr:  "remote error",
			clientErr:  "not node2",
		},
		{
			name: "server CN differs from its DNS SAN",
			server: func(t *testing.T, m *memberSet) Config {
				c, k := issueCustom(t, ca, "node9", []string{"node1"}, now.Add(-time.Minute), now.Add(time.Hour))
				return installPEM(t, trust, "node1", c, k, m)
			},
			client:     func(t *testing.T) Config { return installMember(t, ca, trust, "node2", nil) },
			expectPeer: "node1",
			serverErr:  "remote error",
			clientErr:  `server is member "node9", expected "node1"`,
		},
		{
			name:   "server certificate from another CA",
			server: func(t *testing.T, m *memberSet) Config { return installMember(t, foreign, trust, "node1", m) },
			client: func(t *testing.T) Config { return installMember(t, ca, trust, "node2", nil) },

			expectPeer: "node1",
			serverErr:  "remote error",
			clientErr:  "unknown authority",
		},
		{
			name:   "expired client certificate",
			server: goodServer,
			client: func(t *testing.T) Config {
				c, k := issueCustom(t, ca, "node2", []string{"node2"}, now.Add(-2*time.Hour), now.Add(-time.Hour))
				return installPEM(t, trust, "node2", c, k, nil)
			},
			expectPeer: "node1",
			serverErr:  "expired",
			clientErr:  "remote error",
		},
		{
			name: "expired server certificate",
			server: func(t *testing.T, m *memberSet) Config {
				c, k := issueCustom(t, ca, "node1", []string{"node1"}, now.Add(-2*time.Hour), now.Add(-time.Hour))
				return installPEM(t, trust, "node1", c, k, m)
			},
			client:     func(t *testing.T) Config { return installMember(t, ca, trust, "node2", nil) },
			expectPeer: "node1",
			serverErr:  "remote error",
			clientErr:  "expired",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			members := newMemberSet("node1", "node2")
			srvCfg := tc.server(t, members)
			addr, results := startServer(t, srvCfg)
			cr := clientExchange(t, addr, tc.expectPeer, tc.client(t))
			sr := recvResult(t, results)
			checkSide(t, "server", sr.err, tc.serverErr)
			checkSide(t, "client", cr.err, tc.clientErr)
			if tc.serverErr == "" && sr.peer != "node2" {
				t.Errorf("server learned peer %q, want node2", sr.peer)
			}
			if tc.clientErr == "" && cr.peer != tc.expectPeer {
				t.Errorf("client learned peer %q, want %q", cr.peer, tc.expectPeer)
			}
		})
	}
}

func checkSide(t *testing.T, side string, err error, want string) {
	t.Helper()
	switch {
	case want == "" && err != nil:
		t.Errorf("%s failed: %v", side, err)
	case want != "" && err == nil:
		t.Errorf("%s succeeded, want error containing %q", side, want)
	case want != "" && !strings.Contains(err.Error(), want):
		t.Errorf("%s error = %q, want it to contain %q", side, err, want)
	}
}

// Clients that bypass Dial (no certificate, TLS 1.2) must still be refused.
func TestServerRefusesNonMTLSClients(t *testing.T) {
	ca := mustCA(t, "cluster")
	srv := installMember(t, ca, ca.CertPEM(), "node1", newMemberSet("node1", "node2"))
	client := installMember(t, ca, ca.CertPEM(), "node2", nil)
	full, err := client.ClientTLS("node1")
	if err != nil {
		t.Fatal(err)
	}
	addr, results := startServer(t, srv)

	noCert := full.Clone()
	noCert.GetClientCertificate = nil
	tls12 := full.Clone()
	tls12.MinVersion, tls12.MaxVersion = tls.VersionTLS12, tls.VersionTLS12

	tests := []struct {
		name      string
		conf      *tls.Config
		serverErr string
	}{
		{"no client certificate", noCert, "client didn't provide a certificate"},
		{"TLS 1.2 only", tls12, "unsupported versions"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if err := dialRaw(addr, tc.conf); err == nil {
				t.Fatal("client exchange succeeded, want refusal")
			}
			checkSide(t, "server", recvResult(t, results).err, tc.serverErr)
		})
	}
}

// Replacing files on disk takes effect on the next handshake, without a restart.
func TestRotationWithoutRestart(t *testing.T) {
	ca := mustCA(t, "cluster")
	trust := ca.CertPEM()
	members := newMemberSet("node1", "node2")
	srv := installMember(t, ca, trust, "node1", members)
	client := installMember(t, ca, trust, "node2", nil)
	addr, results := startServer(t, srv)

	first := clientExchange(t, addr, "node1", client)
	if first.err != nil {
		t.Fatalf("first exchange: %v", first.err)
	}
	recvResult(t, results)

	// Server certificate rotation.
	certPEM, keyPEM, err := ca.Issue("node1", nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := WriteFiles(dirOf(srv), "node1", trust, certPEM, keyPEM); err != nil {
		t.Fatal(err)
	}
	second := clientExchange(t, addr, "node1", client)
	if second.err != nil {
		t.Fatalf("exchange after rotation: %v", second.err)
	}
	recvResult(t, results)
	certs, err := parseCertsPEM(certPEM)
	if err != nil {
		t.Fatal(err)
	}
	if second.serverSerial != certs[0].SerialNumber.String() || second.serverSerial == first.serverSerial {
		t.Fatalf("server presented serial %s after rotation, want new serial %s (old %s)",
			second.serverSerial, certs[0].SerialNumber, first.serverSerial)
	}

	// CA rotation, step 1: both sides trust old+new CA, the server moves to a
	// new-CA certificate, and the old-CA client is still accepted.
	newCA := mustCA(t, "cluster-2")
	bundle := append(ca.CertPEM(), newCA.CertPEM()...)
	certPEM, keyPEM, err = newCA.Issue("node1", nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := WriteFiles(dirOf(srv), "node1", bundle, certPEM, keyPEM); err != nil {
		t.Fatal(err)
	}
	if err := atomicfile.WriteFile(client.CAFile, bundle, 0o644); err != nil {
		t.Fatal(err)
	}
	if r := clientExchange(t, addr, "node1", client); r.err != nil {
		t.Fatalf("exchange during CA overlap: %v", r.err)
	}
	recvResult(t, results)

	// Step 2: the server drops the old CA, so the old-CA client is refused.
	if err := atomicfile.WriteFile(srv.CAFile, newCA.CertPEM(), 0o644); err != nil {
		t.Fatal(err)
	}
	_ = clientExchange(t, addr, "node1", client)
	checkSide(t, "server after dropping old CA", recvResult(t, results).err, "unknown authority")

	// Membership change applies to the next connection.
	newClient := installMember(t, newCA, newCA.CertPEM(), "node2", nil)
	if r := clientExchange(t, addr, "node1", newClient); r.err != nil {
		t.Fatalf("exchange with re-issued client: %v", r.err)
	}
	recvResult(t, results)
	members.remove("node2")
	_ = clientExchange(t, addr, "node1", newClient)
	checkSide(t, "server after removal", recvResult(t, results).err, "not a cluster member")
}

func dirOf(c Config) string { return strings.TrimSuffix(c.CAFile, "/"+caCertFile) }

func TestCorruptFilesNameTheFile(t *testing.T) {
	ca := mustCA(t, "cluster")
	other := mustCA(t, "other")
	_, otherKey, err := other.Issue("node1", nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	good := installMember(t, ca, ca.CertPEM(), "node1", newMemberSet("node1"))
	read := func(p string) []byte {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	goodCert := read(good.CertFile)

	tests := []struct {
		name    string
		file    func(Config) string
		content []byte // nil: delete the file
		want    string
	}{
		{"CA garbage", func(c Config) string { return c.CAFile }, []byte("not pem at all"), "no PEM CERTIFICATE block"},
		{"CA truncated", func(c Config) string { return c.CAFile }, ca.CertPEM()[:200], "damaged PEM block"},
		{"CA is a leaf", func(c Config) string { return c.CAFile }, goodCert, "is not a CA certificate"},
		{"CA missing", func(c Config) string { return c.CAFile }, nil, "no such file"},
		{"cert garbage", func(c Config) string { return c.CertFile }, []byte("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"), "certificate block 1"},
		{"cert holds a key", func(c Config) string { return c.CertFile }, otherKey, `"PRIVATE KEY" block`},
		{"key truncated", func(c Config) string { return c.KeyFile }, read(good.KeyFile)[:60], "no PEM private key block"},
		{"key holds a cert", func(c Config) string { return c.KeyFile }, goodCert, `"CERTIFICATE" block`},
		{"key from another cert", func(c Config) string { return c.KeyFile }, otherKey, "does not belong to certificate file"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := installMember(t, ca, ca.CertPEM(), "node1", newMemberSet("node1"))
			path := tc.file(cfg)
			if tc.content == nil {
				if err := os.Remove(path); err != nil {
					t.Fatal(err)
				}
			} else if err := os.WriteFile(path, tc.content, 0o600); err != nil {
				t.Fatal(err)
			}
			for side, err := range map[string]error{
				"ServerTLS": func() error { _, err := cfg.ServerTLS(); return err }(),
				"ClientTLS": func() error { _, err := cfg.ClientTLS("node2"); return err }(),
			} {
				if err == nil {
					t.Fatalf("%s succeeded with corrupt %s", side, path)
				}
				if !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), tc.want) {
					t.Errorf("%s error = %q, want it to name %s and contain %q", side, err, path, tc.want)
				}
			}
		})
	}
}

func TestConfigRejectsMisuse(t *testing.T) {
	ca := mustCA(t, "cluster")
	cfg := installMember(t, ca, ca.CertPEM(), "node1", nil)
	if _, err := cfg.ServerTLS(); err == nil || !strings.Contains(err.Error(), "Members is nil") {
		t.Errorf("ServerTLS without Members: err = %v, want Members is nil", err)
	}
	if _, err := cfg.ClientTLS("10.0.0.1"); err == nil || !strings.Contains(err.Error(), "IP address") {
		t.Errorf("ClientTLS with an IP as peer: err = %v, want IP address refusal", err)
	}
	if _, err := PeerName(&tls.ConnectionState{}); err == nil {
		t.Error("PeerName of an unverified connection succeeded")
	}
	if _, err := PeerName(nil); err == nil {
		t.Error("PeerName(nil) succeeded")
	}
}
