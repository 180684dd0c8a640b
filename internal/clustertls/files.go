package clustertls

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/ftkit/ftkit/internal/atomicfile"
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
		if err := atomicfile.WriteFile(f.path, f.data, f.perm); err != nil {
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
	if err := atomicfile.WriteFile(filepath.Join(dir, caKeyFile), ca.keyPEM, 0o600); err != nil {
		return fmt.Errorf("write CA: %w", err)
	}
	if err := atomicfile.WriteFile(filepath.Join(dir, caCertFile), ca.certPEM, 0o644); err != nil {
		return fmt.Errorf("write CA: %w", err)
	}
	return nil
}
