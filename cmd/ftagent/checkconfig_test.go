package main

import (
	"bytes"
	"crypto"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentconfig"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/internal/clustertls"
	"github.com/ftkit/ftkit/internal/testenv"
)

// checkSetup is a host configuration in a temporary directory: a CA, credentials for node1 written as
// ftctl pki issue writes them, and a config naming them.
type checkSetup struct {
	dir    string
	resolv string // the resolver configuration the check reads
	ca     *clustertls.CA
	tls    clustertls.Config
	config string
}

func newCheckSetup(t *testing.T) *checkSetup {
	t.Helper()
	dir := t.TempDir()
	ca, err := clustertls.NewCA("test-cluster", 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	s := &checkSetup{dir: dir, ca: ca, resolv: filepath.Join(dir, "resolv.conf")}
	if err := os.WriteFile(s.resolv, []byte("nameserver 127.0.0.2\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	s.issue(t, "node1", ca)
	s.config = filepath.Join(dir, "agent.toml")
	toml := fmt.Sprintf(`name = "node1"
state_dir = %q
jobs_dir = %q
socket = %q
[cluster]
listen = "127.0.0.1:7420"
ca = %q
cert = %q
key = %q
[[cluster.member]]
name = "node1"
address = "127.0.0.1:7420"
role = "node"
[[cluster.member]]
name = "node2"
address = "127.0.0.2:7420"
role = "node"
`, filepath.Join(dir, "state"), filepath.Join(dir, "state", "jobs"), filepath.Join(dir, "run", "agent.sock"),
		s.tls.CAFile, s.tls.CertFile, s.tls.KeyFile)
	if err := os.WriteFile(s.config, []byte(toml), 0o600); err != nil {
		t.Fatal(err)
	}
	return s
}

// issue writes a certificate for member from ca into the files the config names (node1's).
func (s *checkSetup) issue(t *testing.T, member string, ca *clustertls.CA) {
	t.Helper()
	cert, key, err := ca.Issue(member, []netip.Addr{netip.MustParseAddr("127.0.0.1")}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	s.write(t, cert, key)
}

func (s *checkSetup) write(t *testing.T, cert, key []byte) {
	t.Helper()
	cfg, err := clustertls.WriteFiles(filepath.Join(s.dir, "pki"), "node1", s.ca.CertPEM(), cert, key)
	if err != nil {
		t.Fatal(err)
	}
	s.tls = cfg
}

// expired signs a node1 certificate with the setup's CA that expired an hour ago.
func (s *checkSetup) expired(t *testing.T) (certPEM, keyPEM []byte) {
	t.Helper()
	caKeyBlock, _ := pem.Decode(s.ca.KeyPEM())
	caKey, err := x509.ParsePKCS8PrivateKey(caKeyBlock.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	caCertBlock, _ := pem.Decode(s.ca.CertPEM())
	caCert, err := x509.ParseCertificate(caCertBlock.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	// A fresh key pair from Issue, re-signed with an expired validity.
	_, keyPEM, err = s.ca.Issue("node1", nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	keyBlock, _ := pem.Decode(keyPEM)
	key, err := x509.ParsePKCS8PrivateKey(keyBlock.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(42),
		Subject:      pkix.Name{CommonName: "node1"},
		DNSNames:     []string{"node1"},
		NotBefore:    time.Now().Add(-3 * time.Hour),
		NotAfter:     time.Now().Add(-time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, key.(crypto.Signer).Public(), caKey)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), keyPEM
}

// lines runs the check and returns its output by line, and its error.
func (s *checkSetup) run(t *testing.T) (map[string]string, string, error) {
	t.Helper()
	var out bytes.Buffer
	err := checkConfig(&out, s.config, s.resolv, time.Now())
	lines := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		status, rest, _ := strings.Cut(l, "  ")
		lines[strings.TrimSpace(rest)] = status
	}
	return lines, out.String(), err
}

// failLine returns the FAIL line whose text starts with prefix, or fails the test.
func failLine(t *testing.T, out, prefix string) string {
	t.Helper()
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "FAIL  "+prefix) {
			return l
		}
	}
	t.Fatalf("no FAIL line for %q in:\n%s", prefix, out)
	return ""
}

func TestCheckConfigGood(t *testing.T) {
	testenv.RequireKernel(t, "CRIU, cgroup v2 and bpffs as the agent needs them")
	s := newCheckSetup(t)
	_, out, err := s.run(t)
	if err != nil {
		t.Fatalf("check-config of a good configuration failed: %v\n%s", err, out)
	}
	if strings.Contains(out, "FAIL") || strings.Count(out, "ok    ") < 16 {
		t.Errorf("want only ok lines, at least 15:\n%s", out)
	}
	// It touched nothing: the state directories the agent would create are still missing.
	for _, d := range []string{"state", "run"} {
		if _, err := os.Lstat(filepath.Join(s.dir, d)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("check-config created %s (%v)", d, err)
		}
	}
}

func TestCheckConfigNamesTheProblem(t *testing.T) {
	tests := []struct {
		name   string
		break_ func(t *testing.T, s *checkSetup)
		line   string // the FAIL line's check
		want   string // in that line
	}{
		{"certificate for another member", func(t *testing.T, s *checkSetup) { s.issue(t, "node2", s.ca) },
			"certificate names member node1", `CN is "node2", not "node1"`},
		{"expired certificate", func(t *testing.T, s *checkSetup) { cert, key := s.expired(t); s.write(t, cert, key) },
			"certificate is valid now", "expired"},
		{"missing key", func(t *testing.T, s *checkSetup) { os.Remove(s.tls.KeyFile) },
			"certificate ", "read key file"},
		{"key readable by others", func(t *testing.T, s *checkSetup) { os.Chmod(s.tls.KeyFile, 0o644) },
			"key ", "chmod 600"},
		{"CA file writable by others", func(t *testing.T, s *checkSetup) { os.Chmod(s.tls.CAFile, 0o666) },
			"CA file", "chmod go-w"},
		{"CA file in a directory others may write", func(t *testing.T, s *checkSetup) { os.Chmod(filepath.Dir(s.tls.CAFile), 0o777) },
			"CA file", "chmod go-w"},
		{"CRL writable by others", func(t *testing.T, s *checkSetup) {
			pem, err := s.ca.Revoke(nil, []*big.Int{big.NewInt(99)}, time.Now())
			if err != nil {
				t.Fatal(err)
			}
			crl := filepath.Join(s.dir, "ca.crl")
			os.WriteFile(crl, pem, 0o666)
			os.Chmod(crl, 0o666)
			b, _ := os.ReadFile(s.config)
			os.WriteFile(s.config, bytes.Replace(b, []byte("[[cluster.member]]"), []byte(fmt.Sprintf("crl = %q\n[[cluster.member]]", crl)), 1), 0o600)
		}, "CRL file", "chmod go-w"},
		{"certificate from another CA", func(t *testing.T, s *checkSetup) {
			other, err := clustertls.NewCA("other", time.Hour*24)
			if err != nil {
				t.Fatal(err)
			}
			s.issue(t, "node1", other)
		}, "certificate is signed by the cluster CA", "unknown authority"},
		{"missing CA", func(t *testing.T, s *checkSetup) { os.Remove(s.tls.CAFile) },
			"CA file", "no such file"},
		{"listen address not on this host", func(t *testing.T, s *checkSetup) {
			b, _ := os.ReadFile(s.config)
			os.WriteFile(s.config, bytes.ReplaceAll(b, []byte(`"127.0.0.1:7420"`), []byte(`"192.0.2.1:7420"`)), 0o600) // listen and member
		}, "cluster.listen", "no interface"},
		{"state_dir open to others", func(t *testing.T, s *checkSetup) {
			os.Mkdir(filepath.Join(s.dir, "state"), 0o777)
			os.Chmod(filepath.Join(s.dir, "state"), 0o777)
		},
			"state_dir", "chmod go-w"},
		{"fence command writable by others", func(t *testing.T, s *checkSetup) {
			prog := filepath.Join(s.dir, "fence")
			os.WriteFile(prog, []byte("#!/bin/sh\n"), 0o755)
			os.Chmod(prog, 0o757)
			b, _ := os.ReadFile(s.config)
			os.WriteFile(s.config, append(b, fmt.Sprintf("[failover]\nfence_command = [%q, \"{host}\"]\n", prog)...), 0o600)
		}, "failover.fence_command", "chmod go-w"},
		{"start-job command writable by others", func(t *testing.T, s *checkSetup) {
			prog := filepath.Join(s.dir, "admit")
			os.WriteFile(prog, []byte("#!/bin/sh\n"), 0o755)
			os.Chmod(prog, 0o775)
			b, _ := os.ReadFile(s.config)
			line := fmt.Sprintf("start_job_command = [%q, \"{uid}\", \"{host}\"]\n[[cluster.member]]", prog)
			os.WriteFile(s.config, bytes.Replace(b, []byte("[[cluster.member]]"), []byte(line), 1), 0o600)
		}, "cluster.start_job_command", "chmod go-w"},
		{"job address pool outside the cluster network", func(t *testing.T, s *checkSetup) {
			b, _ := os.ReadFile(s.config)
			os.WriteFile(s.config, append(b, "[job_network]\npool = \"10.9.0.200/29\"\n"...), 0o600)
		}, "job_network.pool", "not inside the cluster network 127.0.0.0/8"},
		{"job address pool holding a member's address", func(t *testing.T, s *checkSetup) {
			b, _ := os.ReadFile(s.config)
			os.WriteFile(s.config, append(b, "[job_network]\npool = \"127.0.0.0/30\"\n"...), 0o600)
		}, "job_network.pool", "holds member node1's address"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := newCheckSetup(t)
			tc.break_(t, s)
			_, out, err := s.run(t)
			if err == nil {
				t.Fatalf("check-config passed:\n%s", out)
			}
			if ee, ok := errors.AsType[*cli.ExitError](err); ok {
				t.Errorf("exit code %d, want 1 (a check failed)", ee.Code)
			}
			if l := failLine(t, out, tc.line); !strings.Contains(l, tc.want) {
				t.Errorf("FAIL line %q does not say %q", l, tc.want)
			}
		})
	}
}

// TestCheckConfigJobNameservers: with job addresses, a nameserver a job network cannot reach is a warning
// (WARN, exit 0), and a reachable one passes. The cases of each kind of nameserver are
// agent.TestUnreachableNameservers' (this test's cluster network is loopback).
func TestCheckConfigJobNameservers(t *testing.T) {
	testenv.RequireKernel(t, "CRIU, cgroup v2 and bpffs as the agent needs them")
	for _, tc := range []struct {
		name, resolv, gateway string
		want                  string // in the WARN line; "" for an ok line
	}{
		{"beyond it through the gateway", "search example\nnameserver 10.255.255.53\n", "127.0.0.9", ""},
		{"beyond it without a gateway", "nameserver 10.255.255.53\n", "", "set it to the router"},
		{"IPv6", "nameserver 10.255.255.53\nnameserver 2001:db8::53\n", "127.0.0.9", "IPv4 only"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newCheckSetup(t)
			if err := os.WriteFile(s.resolv, []byte(tc.resolv), 0o644); err != nil {
				t.Fatal(err)
			}
			jn := "[job_network]\npool = \"127.0.0.200/29\"\n"
			if tc.gateway != "" {
				jn += fmt.Sprintf("gateway = %q\n", tc.gateway)
			}
			b, _ := os.ReadFile(s.config)
			os.WriteFile(s.config, append(b, jn...), 0o600)
			lines, out, err := s.run(t)
			if err != nil {
				t.Fatalf("check-config failed: %v\n%s", err, out)
			}
			what := "nameservers of " + s.resolv + " reachable from job networks"
			if tc.want == "" {
				if lines[what] != "ok" {
					t.Errorf("want an ok line for %q:\n%s", what, out)
				}
				return
			}
			for _, l := range strings.Split(out, "\n") {
				if strings.HasPrefix(l, "WARN  "+what) && strings.Contains(l, tc.want) {
					return
				}
			}
			t.Errorf("no WARN line for %q saying %q:\n%s", what, tc.want, out)
		})
	}
}

func TestCheckConfigInvalidFile(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct{ name, content, want string }{
		{"unknown key", "name = \"node1\"\nstate_dri = \"/x\"\n", "unknown key"},
		{"not a member", "name = \"node9\"\n[[cluster.member]]\nname = \"node1\"\naddress = \"10.0.0.1:7420\"\nrole = \"node\"\n[[cluster.member]]\nname = \"node2\"\naddress = \"10.0.0.2:7420\"\nrole = \"node\"\n", "not a cluster.member"},
		{"missing file", "", "no such file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "_")+".toml")
			if tc.content != "" {
				os.WriteFile(path, []byte(tc.content), 0o600)
			}
			var out bytes.Buffer
			err := checkConfig(&out, path, "/nonexistent", time.Now())
			ee, ok := errors.AsType[*cli.ExitError](err)
			if !ok || ee.Code != cli.ExitUsage {
				t.Errorf("error %v, want exit %d", err, cli.ExitUsage)
			}
			if !strings.HasPrefix(out.String(), "FAIL  configuration") || !strings.Contains(out.String(), tc.want) {
				t.Errorf("output %q does not name %q", out.String(), tc.want)
			}
		})
	}
}

func TestKernelAtLeast(t *testing.T) {
	for _, tc := range []struct {
		release string
		ok      bool
	}{
		{"6.6.0", true}, {"6.18.44-fc-v769", true}, {"7.0.1", true}, {"6.8.0-45-generic", true}, {"6.6-rc1", true},
		{"6.5.13", false}, {"5.15.0-91-generic", false}, {"6", false}, {"x.y", false}, {"", false},
	} {
		if err := kernelAtLeast(tc.release, [2]int{6, 6}); (err == nil) != tc.ok {
			t.Errorf("kernelAtLeast(%q) = %v, want ok=%v", tc.release, err, tc.ok)
		}
	}
}

func TestSafeDirPath(t *testing.T) {
	testenv.RequireKernel(t, "root, to own the directories checked")
	tests := []struct {
		name   string
		setup  func(t *testing.T, base string) string // returns the directory to check
		shared bool
		want   string // "" means safe
	}{
		{"missing below a private dir", func(t *testing.T, b string) string { return filepath.Join(b, "a", "b") }, false, ""},
		{"existing private dir", func(t *testing.T, b string) string {
			os.Mkdir(filepath.Join(b, "s"), 0o700)
			return filepath.Join(b, "s")
		}, false, ""},
		{"parent writable by others", func(t *testing.T, b string) string {
			os.Mkdir(filepath.Join(b, "p"), 0o777)
			os.Chmod(filepath.Join(b, "p"), 0o777)
			return filepath.Join(b, "p", "s")
		}, false, "not sticky"},
		{"missing in a sticky world-writable dir", func(t *testing.T, b string) string {
			os.Mkdir(filepath.Join(b, "tmp"), 0o777)
			os.Chmod(filepath.Join(b, "tmp"), 0o777|os.ModeSticky)
			return filepath.Join(b, "tmp", "s")
		}, false, "create it first"},
		{"root's dir in a sticky dir", func(t *testing.T, b string) string {
			os.Mkdir(filepath.Join(b, "tmp"), 0o777)
			os.Chmod(filepath.Join(b, "tmp"), 0o777|os.ModeSticky)
			os.Mkdir(filepath.Join(b, "tmp", "s"), 0o700)
			return filepath.Join(b, "tmp", "s")
		}, false, ""},
		{"owned by another user", func(t *testing.T, b string) string {
			os.Mkdir(filepath.Join(b, "u"), 0o700)
			os.Chown(filepath.Join(b, "u"), 65534, 65534)
			return filepath.Join(b, "u", "s")
		}, false, "uid 65534"},
		{"a file", func(t *testing.T, b string) string {
			os.WriteFile(filepath.Join(b, "f"), nil, 0o600)
			return filepath.Join(b, "f")
		}, false, "not a directory"},
		{"sticky shared jobs dir", func(t *testing.T, b string) string {
			os.Mkdir(filepath.Join(b, "jobs"), 0o777)
			os.Chmod(filepath.Join(b, "jobs"), 0o777|os.ModeSticky)
			return filepath.Join(b, "jobs")
		}, true, ""},
		// A link on the way is followed as the agent's open follows it: a root's directory inside a user's
		// one can be renamed by that user and replaced by theirs.
		{"link into a user's dir", func(t *testing.T, b string) string {
			os.Mkdir(filepath.Join(b, "home"), 0o755)
			os.Chown(filepath.Join(b, "home"), 65534, 65534)
			os.Mkdir(filepath.Join(b, "home", "st"), 0o700)
			os.Symlink(filepath.Join(b, "home", "st"), filepath.Join(b, "state"))
			return filepath.Join(b, "state", "sub")
		}, false, "uid 65534"},
		{"link to a root's dir", func(t *testing.T, b string) string {
			os.Mkdir(filepath.Join(b, "data"), 0o755)
			os.Mkdir(filepath.Join(b, "data", "st"), 0o700)
			os.Symlink(filepath.Join(b, "data", "st"), filepath.Join(b, "state"))
			return filepath.Join(b, "state", "sub")
		}, false, ""},
		{"sticky state dir", func(t *testing.T, b string) string {
			os.Mkdir(filepath.Join(b, "st"), 0o777)
			os.Chmod(filepath.Join(b, "st"), 0o777|os.ModeSticky)
			return filepath.Join(b, "st")
		}, false, "root's alone"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := tc.setup(t, t.TempDir())
			err := safeDirPath(dir, tc.shared)
			if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
				t.Errorf("safeDirPath(%s) = %v, want %q", dir, err, tc.want)
			}
		})
	}
}

// TestCheckCRIUUnpatchedWarns: a CRIU 4.2 or newer without ftkit's patches (a site's own build, which
// docs/deploy.md allows with `criu =`) is what the agent runs with, warning: --check-config warns too,
// instead of failing the host.
func TestCheckCRIUUnpatchedWarns(t *testing.T) {
	real, err := exec.LookPath("/usr/local/sbin/criu")
	if err != nil {
		t.Skipf("SKIPPED: no CRIU at /usr/local/sbin/criu (scripts/setup.sh criu): %v", err)
	}
	// The real CRIU, but `criu --version` names no patch level, as an unpatched 4.2.1 does.
	fake := filepath.Join(t.TempDir(), "criu")
	script := "#!/bin/sh\n[ \"$1\" = --version ] && { echo 'Version: 4.2.1'; exit 0; }\nexec " + real + " \"$@\"\n"
	if err := os.WriteFile(fake, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	checks := checkCRIU(fake)
	var buf bytes.Buffer
	printChecks(&buf, checks)
	t.Logf("\n%s", buf.String())
	for _, c := range checks {
		if c.err != nil && !c.warns() {
			t.Errorf("%s: FAIL (%v), want a warning: the agent runs with this CRIU", c.what, c.err)
		}
	}
}

// A host configured without [cluster] passes Validate, but the agent serves the cluster protocol whatever
// its members (Run: serveCluster), and clustertls.Listen refuses to start without cluster.listen and the
// CA, certificate and key: --check-config must not say ok to a configuration the agent exits on at start.
func TestCheckConfigNoMembersStillNeedsTheClusterFiles(t *testing.T) {
	cfg := agentconfig.Defaults()
	cfg.Name = "node1"
	if err := cfg.Validate(); err != nil {
		t.Fatalf("test bug: %v", err)
	}
	// What the agent's Run does first with this configuration (agent.serveCluster, agent.tlsConfig).
	_, err := clustertls.Listen(cfg.Cluster.Listen.String(), clustertls.Config{CAFile: cfg.Cluster.CA, CertFile: cfg.Cluster.Cert,
		KeyFile: cfg.Cluster.Key, Members: func(string) bool { return true }})
	if err == nil {
		t.Fatal("the cluster listener started without credentials")
	}
	t.Logf("the agent would exit: %v", err)
	for _, c := range append(credentialChecks(cfg, time.Now()), checkListen(cfg)) {
		if c.err == nil {
			t.Errorf("ok    %s", c.what)
		}
	}
}

// TestCheckStartJobCommand: --check-config says whether the start-job command is set, and refuses a program
// root alone cannot change (the agent would refuse to run it, and so every job another member forwards).
func TestCheckStartJobCommand(t *testing.T) {
	dir := t.TempDir()
	prog := func(name string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte("#!/bin/sh\nexit 0\n"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	for _, tc := range []struct {
		name string
		argv []string
		what string // the line's check
		err  string // "": it passes
	}{
		{"none", nil, "cluster.start_job_command: none", ""},
		{"root's alone", []string{prog("good", 0o755), "{uid}"}, "cluster.start_job_command " + filepath.Join(dir, "good") + " is root's alone", ""},
		{"writable by the group", []string{prog("group", 0o775)}, "cluster.start_job_command", "chmod go-w"},
		{"not executable", []string{prog("plain", 0o644)}, "cluster.start_job_command", "not executable"},
		{"missing", []string{filepath.Join(dir, "missing")}, "cluster.start_job_command", "no such file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var cfg agent.Config
			cfg.Cluster.StartJobCommand = tc.argv
			c := checkStartJobCommand(cfg)
			if !strings.HasPrefix(c.what, tc.what) || (tc.err == "") != (c.err == nil) || c.err != nil && !strings.Contains(c.err.Error(), tc.err) {
				t.Errorf("check %q: %v; want %q, error with %q", c.what, c.err, tc.what, tc.err)
			}
		})
	}
}
