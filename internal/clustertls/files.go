package clustertls

import (
	"fmt"
	"os"
	"path/filepath"
)

// File names used by WriteFiles and WriteCA. The CA files contain '_', which
// ValidateMemberName forbids, so no member can overwrite them.
const (
	caCertFile = "cluster_ca.crt"
	caKeyFile  = "cluster_ca.key"
)

// WriteFiles installs a member's credentials in dir (created 0700 if missing):
// cluster_ca.crt and <member>.crt with mode 0644, <member>.key with mode 0600.
// Each file is replaced atomically. It returns a Config pointing at the files;
// the caller still has to set Members.
func WriteFiles(dir, member string, caCertPEM, certPEM, keyPEM []byte) (Config, error) {
	if err := ValidateMemberName(member); err != nil {
		return Config{}, fmt.Errorf("write credentials: %w", err)
	}
	cfg := Config{
		CAFile:   filepath.Join(dir, caCertFile),
		CertFile: filepath.Join(dir, member+".crt"),
		KeyFile:  filepath.Join(dir, member+".key"),
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return Config{}, fmt.Errorf("write credentials for %q: create directory: %w", member, err)
	}
	// The renames are atomic per file, not as a set: a handshake that reads
	// between the key and certificate renames fails on a key mismatch (clear
	// error, nothing half-read), and the next handshake sees the finished pair.
	for _, f := range []struct {
		path string
		data []byte
		perm os.FileMode
	}{
		{cfg.CAFile, caCertPEM, 0o644},
		{cfg.KeyFile, keyPEM, 0o600},
		{cfg.CertFile, certPEM, 0o644},
	} {
		if err := writeFileAtomic(f.path, f.data, f.perm); err != nil {
			return Config{}, fmt.Errorf("write credentials for %q: %w", member, err)
		}
	}
	return cfg, nil
}

// WriteCA stores the CA as cluster_ca.crt (0644) and cluster_ca.key (0600) in
// dir (created 0700 if missing), each replaced atomically.
func WriteCA(dir string, ca *CA) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("write CA: create directory: %w", err)
	}
	if err := writeFileAtomic(filepath.Join(dir, caKeyFile), ca.keyPEM, 0o600); err != nil {
		return fmt.Errorf("write CA: %w", err)
	}
	if err := writeFileAtomic(filepath.Join(dir, caCertFile), ca.certPEM, 0o644); err != nil {
		return fmt.Errorf("write CA: %w", err)
	}
	return nil
}

// writeFileAtomic replaces path with data so that readers see either the old
// or the new content, never a mix, and a crash leaves no partial file. The
// temp file gets perm before any secret is written to it.
func writeFileAtomic(path string, data []byte, perm os.FileMode) (err error) {
	dir := filepath.Dir(path)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("create temp file for %s: %w", path, err)
	}
	defer func() {
		if err != nil {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	if err := tmp.Chmod(perm); err != nil {
		return fmt.Errorf("chmod temp file for %s: %w", path, err)
	}
	if _, err := tmp.Write(data); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("close %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("rename into %s: %w", path, err)
	}
	// Persist the rename itself.
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("open directory %s to fsync: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync directory %s: %w", dir, err)
	}
	return nil
}
