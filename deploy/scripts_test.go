package deploy

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// runScript runs the maintainer script name with args as dpkg would on a host booted with systemd, with a
// systemctl that records its arguments, and returns them one call a line. The script's test for systemd
// (/run/systemd/system) is pointed at a directory of the test's.
func runScript(t *testing.T, name string, args ...string) string {
	t.Helper()
	src, err := os.ReadFile(filepath.Join("scripts", name))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	booted := filepath.Join(dir, "run-systemd-system")
	if err := os.Mkdir(booted, 0o755); err != nil {
		t.Fatal(err)
	}
	script := filepath.Join(dir, name)
	if err := os.WriteFile(script, []byte(strings.ReplaceAll(string(src), "/run/systemd/system", booted)), 0o755); err != nil {
		t.Fatal(err)
	}
	bin, calls := filepath.Join(dir, "bin"), filepath.Join(dir, "calls")
	if err := os.Mkdir(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bin, "systemctl"), []byte("#!/bin/sh\necho \"$*\" >>"+calls+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sh", append([]string{script}, args...)...)
	cmd.Env = []string{"PATH=" + bin + ":/usr/bin:/bin"}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s %v: %v\n%s", name, args, err, out)
	}
	b, _ := os.ReadFile(calls)
	return string(b)
}

// Removing the package deletes the unit file: systemd must reload, or it keeps the removed unit loaded
// (systemctl status shows it, "changed on disk"), as dh_installsystemd's postrm does on remove. An
// upgrade's postrm leaves that to the new postinst.
func TestMaintainerScriptsReloadSystemd(t *testing.T) {
	if got := runScript(t, "prerm", "remove"); got != "disable --now ftagent.service\n" {
		t.Errorf("prerm remove ran systemctl %q, want disable --now ftagent.service", got)
	}
	if got := runScript(t, "postrm", "remove"); got != "daemon-reload\n" {
		t.Errorf("postrm remove ran systemctl %q, want daemon-reload", got)
	}
	if got := runScript(t, "postinst", "configure", "1.0"); got != "daemon-reload\ntry-restart ftagent.service\n" {
		t.Errorf("postinst configure (an upgrade) ran systemctl %q, want daemon-reload and try-restart", got)
	}
	if got := runScript(t, "postrm", "upgrade", "2.0"); got != "" {
		t.Errorf("postrm upgrade ran systemctl %q, want nothing (postinst reloads)", got)
	}
}
