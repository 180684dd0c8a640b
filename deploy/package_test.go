package deploy

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/internal/testenv"
)

// run runs a command with a generous failure timeout and returns its stdout, stderr and error.
func run(t *testing.T, dir string, name string, args ...string) (string, string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = dir
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	return out.String(), errb.String(), err
}

func need(t *testing.T, tools ...string) {
	t.Helper()
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("SKIPPED: %s is not installed (scripts/setup.sh installs it): cannot build or install the .deb", tool)
		}
	}
}

// TestPackageInstalls builds the .deb with `make package`, installs it with dpkg into an empty root, and
// checks the files, their modes and the conffile, the unit (systemd-analyze verify), and the installed
// binaries: ftctl issues member credentials, and ftagent --check-config passes on the installed example
// configuration once it points at them and at this host (systemd is not PID 1 here, so the unit cannot
// be started).
func TestPackageInstalls(t *testing.T) {
	testenv.RequireKernel(t, "root, to install a package into a temporary root with dpkg")
	need(t, "make", "dpkg", "dpkg-deb", "go")
	repo, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	out := t.TempDir()
	if stdout, stderr, err := run(t, repo, "make", "package", "PKGOUT="+out); err != nil {
		t.Fatalf("make package: %v\n%s%s", err, stdout, stderr)
	}
	debs, _ := filepath.Glob(filepath.Join(out, "ftkit_*_amd64.deb"))
	if len(debs) != 1 {
		t.Fatalf("make package wrote %v, want one ftkit_*_amd64.deb", debs)
	}
	version, _, err := run(t, repo, "dpkg-deb", "--field", debs[0], "Version")
	if err != nil || !regexp.MustCompile(`^[0-9][A-Za-z0-9.+~]*$`).MatchString(strings.TrimSpace(version)) {
		t.Errorf("package version %q (%v): want a Debian version from git describe", version, err)
	}

	root := t.TempDir()
	admin := filepath.Join(root, "var/lib/dpkg")
	for _, d := range []string{"info", "updates"} {
		if err := os.MkdirAll(filepath.Join(admin, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{"status", "available"} {
		if err := os.WriteFile(filepath.Join(admin, f), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// The maintainer scripts run outside the empty root (it has no shell), with DPKG_ROOT set: they do nothing.
	if stdout, stderr, err := run(t, repo, "dpkg", "--root="+root, "--admindir="+admin, "--log=/dev/null", "--force-script-chrootless", "-i", debs[0]); err != nil {
		t.Fatalf("dpkg -i into %s: %v\n%s%s", root, err, stdout, stderr)
	}
	for _, f := range []struct {
		path string
		mode os.FileMode
	}{
		{"usr/sbin/ftagent", 0o755},
		{"usr/bin/ftctl", 0o755},
		{"usr/bin/ftwrap", 0o755},
		{"usr/lib/ftkit/libftkit-mpich.so", 0o644},
		{strings.TrimPrefix(SlurmStartJobPath, "/"), 0o755},
		{"lib/systemd/system/ftagent.service", 0o644},
		{"etc/ftkit/agent.toml", 0o644},
		{"etc/ftkit/pki", 0o700 | os.ModeDir},
		{"usr/share/bash-completion/completions/ftctl", 0o644},
		{"usr/share/zsh/vendor-completions/_ftctl", 0o644},
		{"usr/share/doc/ftkit/README.md", 0o644},
		{"usr/share/doc/ftkit/deploy.md", 0o644},
		{"usr/share/doc/ftkit/agent.example.toml", 0o644},
	} {
		fi, err := os.Lstat(filepath.Join(root, f.path))
		if err != nil {
			t.Errorf("installed %s: %v", f.path, err)
			continue
		}
		if fi.Mode() != f.mode {
			t.Errorf("installed %s: mode %v, want %v", f.path, fi.Mode(), f.mode)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(root, "usr/share/bash-completion/completions/ftctl")); !bytes.Contains(b, []byte("__start_ftctl")) {
		t.Error("the bash completion is not cobra's completion script for ftctl")
	}
	// An upgrade must restart the running agent on the new binary, a removal stop it: systemd does neither itself.
	for _, script := range []string{"postinst", "prerm", "postrm"} {
		if _, err := os.Stat(filepath.Join(admin, "info", "ftkit."+script)); err != nil {
			t.Errorf("the package has no %s: %v", script, err)
		}
	}
	// The host's configuration is no conffile: every change to the example would stop an unattended upgrade
	// at dpkg's conffile prompt. The first install writes it; an upgrade keeps the host's edits.
	conffiles, _, err := run(t, repo, "dpkg-query", "--admindir="+admin, "-W", "-f=${Conffiles}", "ftkit")
	if err != nil || strings.Contains(conffiles, "/etc/ftkit/agent.toml") {
		t.Errorf("conffiles %q (%v): /etc/ftkit/agent.toml must not be one", conffiles, err)
	}
	conf := filepath.Join(root, "etc/ftkit/agent.toml")
	shipped, _ := os.ReadFile(filepath.Join(root, "usr/share/doc/ftkit/agent.example.toml"))
	if b, err := os.ReadFile(conf); err != nil || !bytes.Equal(b, shipped) {
		t.Errorf("the first install's %s (%v) is not the documented example", conf, err)
	}
	edited := append(slices.Clone(shipped), "# edited on this host\n"...)
	if err := os.WriteFile(conf, edited, 0o644); err != nil {
		t.Fatal(err)
	}
	if stdout, stderr, err := run(t, repo, "dpkg", "--root="+root, "--admindir="+admin, "--log=/dev/null", "--force-script-chrootless", "-i", debs[0]); err != nil {
		t.Fatalf("dpkg -i again (an upgrade) into %s: %v\n%s%s", root, err, stdout, stderr)
	}
	if b, err := os.ReadFile(conf); err != nil || !bytes.Equal(b, edited) {
		t.Errorf("an upgrade did not keep the host's %s (%v)", conf, err)
	}

	ftagent, ftctl := filepath.Join(root, "usr/sbin/ftagent"), filepath.Join(root, "usr/bin/ftctl")
	verifyUnit(t, root, ftagent)

	// The installed example configuration as shipped: valid, but its credentials are not there yet.
	stdout, _, err := run(t, root, ftagent, "--check-config", "--config", filepath.Join(root, "etc/ftkit/agent.toml"))
	t.Logf("ftagent --check-config on the installed example:\n%s", stdout)
	if !strings.HasPrefix(stdout, "ok    configuration ") {
		t.Errorf("the installed example configuration is not valid: %v\n%s", err, stdout)
	}
	if _, statErr := os.Stat("/etc/ftkit/pki/cluster_ca.crt"); os.IsNotExist(statErr) &&
		(err == nil || !strings.Contains(stdout, "FAIL  CA file /etc/ftkit/pki/cluster_ca.crt")) {
		t.Errorf("--check-config without credentials: %v; want a FAIL line naming the missing CA file", err)
	}

	// Credentials from the installed ftctl, and the example pointed at them, this root and this host.
	pki := filepath.Join(root, "etc/ftkit/pki")
	ca := filepath.Join(t.TempDir(), "ca")
	for _, args := range [][]string{
		{"pki", "init", "--dir", ca, "--name", "package-test"},
		{"pki", "issue", "--dir", ca, "node1", "--address", "127.0.0.1", "--out", pki},
	} {
		if stdout, stderr, err := run(t, root, ftctl, args...); err != nil {
			t.Fatalf("installed ftctl %v: %v\n%s%s", args, err, stdout, stderr)
		}
	}
	example, err := os.ReadFile(filepath.Join(root, "etc/ftkit/agent.toml"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := strings.NewReplacer(
		`"/etc/ftkit/`, `"`+root+`/etc/ftkit/`,
		`"/var/lib/ftkit`, `"`+root+`/var/lib/ftkit`,
		`"/run/ftkit/`, `"`+root+`/run/ftkit/`,
		`10.201.0.11:7420`, `127.0.0.1:7420`,
	).Replace(string(example))
	cfgPath := filepath.Join(root, "etc/ftkit/test.toml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	stdout, stderr, err := run(t, root, ftagent, "--check-config", "--config", cfgPath)
	t.Logf("ftagent --check-config with credentials from ftctl pki:\n%s", stdout)
	if err != nil || strings.Contains(stdout, "FAIL") {
		t.Errorf("installed ftagent --check-config: %v\n%s%s", err, stdout, stderr)
	}
	for _, d := range []string{"var/lib/ftkit", "run/ftkit"} {
		if _, err := os.Lstat(filepath.Join(root, d)); !os.IsNotExist(err) {
			t.Errorf("--check-config created %s (%v)", d, err)
		}
	}
}

// verifyUnit runs systemd-analyze verify on the installed unit. It checks that ExecStart's binary exists,
// so a copy points ExecStart into the temporary root; unknown keys are warnings on stderr with exit 0,
// so any output fails the test.
func verifyUnit(t *testing.T, root, ftagent string) {
	t.Helper()
	if _, err := exec.LookPath("systemd-analyze"); err != nil {
		t.Log("SKIPPED the unit check: systemd-analyze is not installed")
		return
	}
	unit, err := os.ReadFile(filepath.Join(root, "lib/systemd/system/ftagent.service"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(unit, []byte("ExecStart=/usr/sbin/ftagent ")) {
		t.Errorf("the unit does not start the installed /usr/sbin/ftagent:\n%s", unit)
	}
	copyPath := filepath.Join(t.TempDir(), "ftagent.service")
	if err := os.WriteFile(copyPath, bytes.ReplaceAll(unit, []byte("/usr/sbin/ftagent"), []byte(ftagent)), 0o644); err != nil {
		t.Fatal(err)
	}
	stdout, stderr, err := run(t, root, "systemd-analyze", "verify", copyPath)
	if err != nil || strings.TrimSpace(stdout+stderr) != "" {
		t.Errorf("systemd-analyze verify ftagent.service: %v\n%s%s", err, stdout, stderr)
	}
}
