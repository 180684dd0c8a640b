package main

import (
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"math/big"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/atomicfile"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/internal/clustertls"
)

// File names of the CA in a pki directory; clustertls.WriteCA writes them and WriteFiles puts a copy of
// the certificate beside every member's credentials.
const (
	caCertName = "cluster_ca.crt"
	caKeyName  = "cluster_ca.key"
	crlName    = "cluster_ca.crl"
	// maxPEM bounds what is read back from a pki directory: a CA certificate or key is well under 4 KiB.
	maxPEM = 64 << 10
	// maxCRL bounds the revocation list read back (about 40 bytes per revoked certificate).
	maxCRL = 8 << 20
)

// validity is a duration flag that also takes whole days ("365d"), the unit certificates are thought in.
type validity struct{ d *time.Duration }

func (v validity) String() string {
	if v.d == nil {
		return ""
	}
	if *v.d%(24*time.Hour) == 0 {
		return strconv.FormatInt(int64(*v.d/(24*time.Hour)), 10) + "d"
	}
	return v.d.String()
}

func (v validity) Set(s string) error {
	d, err := parseValidity(s)
	if err != nil {
		return err
	}
	*v.d = d
	return nil
}

func (v validity) Type() string { return "duration" }

func parseValidity(s string) (time.Duration, error) {
	var d time.Duration
	if days, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.ParseInt(days, 10, 32)
		if err != nil {
			return 0, fmt.Errorf("%q: use whole days (365d) or a Go duration (8760h)", s)
		}
		if n > int64(math.MaxInt64/(24*time.Hour)) {
			return 0, fmt.Errorf("%q: at most %d days", s, int64(math.MaxInt64/(24*time.Hour)))
		}
		d = time.Duration(n) * 24 * time.Hour
	} else {
		var err error
		if d, err = time.ParseDuration(s); err != nil {
			return 0, fmt.Errorf("%q: use whole days (365d) or a Go duration (8760h)", s)
		}
	}
	if d <= 0 {
		return 0, fmt.Errorf("%q: the validity must be positive", s)
	}
	return d, nil
}

func newPKICmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "pki",
		Short: "Create the cluster CA and the certificates of members and operators",
		Long: `Agents authenticate each other with mutual TLS: every member presents a certificate signed by the
cluster CA whose common name and DNS name are its member name (the name in [[cluster.member]]), never
its address. 'pki init' creates the CA once, on a host that is not a cluster member; 'pki issue' signs a
certificate for each member, to be copied to that host (docs/deploy.md). Keep cluster_ca.key off the
members: whoever holds it can join the cluster.`,
	}
	cmd.AddCommand(newPKIInitCmd(), newPKIIssueCmd(), newPKIRevokeCmd())
	return cmd
}

func newPKIInitCmd() *cobra.Command {
	var dir, name string
	var force bool
	valid := 10 * 365 * 24 * time.Hour
	cmd := &cobra.Command{
		Use:   "init --dir DIR [--name CLUSTER] [--validity 3650d]",
		Short: "Create the cluster CA in DIR (cluster_ca.crt, cluster_ca.key)",
		Long: `Create the cluster CA: an ECDSA P-256 certificate that may sign member certificates only, and its key.
DIR is created 0700 if missing; an existing DIR must be a real directory (not a symbolic link) that only
its owner can access. cluster_ca.key is written 0600, cluster_ca.crt 0644, each atomically. An existing CA
is kept unless --force: replacing it invalidates every certificate it signed.`,
		Args: cli.Args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if strings.TrimSpace(name) == "" {
				return cli.Usagef("--name must not be empty")
			}
			if err := privateDir(dir); err != nil {
				return err
			}
			for _, f := range []string{caCertName, caKeyName} {
				p := filepath.Join(dir, f)
				fi, err := os.Lstat(p)
				switch {
				case errors.Is(err, fs.ErrNotExist):
				case err != nil:
					return fmt.Errorf("pki init: %w", err)
				case !fi.Mode().IsRegular():
					return fmt.Errorf("pki init: %s exists and is not a regular file; remove it", p)
				case !force:
					return cli.WithCode(cli.ExitUnavailable, fmt.Errorf("pki init: %s exists: a CA is already there (pass --force to replace it and invalidate every certificate it signed)", p))
				}
			}
			ca, err := clustertls.NewCA(name, valid)
			if err != nil {
				return fmt.Errorf("pki init: %w", err)
			}
			if err := clustertls.WriteCA(dir, ca); err != nil {
				return fmt.Errorf("pki init: %w", err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "cluster CA %q created, valid %s: %s (keep private, off the members), %s (copy to every member)\n",
				name, validity{&valid}, filepath.Join(dir, caKeyName), filepath.Join(dir, caCertName))
			return nil
		},
	}
	cmd.Flags().StringVar(&dir, "dir", "", "directory for the CA (created 0700)")
	cmd.Flags().StringVar(&name, "name", "ftkit-cluster", "the CA's common name: name the cluster")
	cmd.Flags().Var(validity{&valid}, "validity", "how long the CA is valid: days (3650d) or a Go duration")
	cmd.Flags().BoolVar(&force, "force", false, "replace an existing CA")
	cmd.MarkFlagRequired("dir")
	return cmd
}

func newPKIIssueCmd() *cobra.Command {
	var dir, out string
	var addrs []string
	var operator bool
	valid := 365 * 24 * time.Hour
	cmd := &cobra.Command{
		Use:   "issue --dir DIR HOST [--address IP]... [--out OUTDIR] | issue --dir DIR --operator NAME",
		Short: "Sign a member certificate for HOST (or an operator's client certificate) with the CA in DIR",
		Long: `Sign a certificate with the CA in DIR and write it to OUTDIR (default DIR/HOST, or DIR/operator-NAME)
with a copy of the CA certificate: cluster_ca.crt and HOST.crt (0644), HOST.key (0600), in a directory
only its owner can access. Copy OUTDIR to the host as /etc/ftkit/pki and point the agent's [cluster]
ca, cert and key at the files.

A member certificate carries HOST as its common name and DNS name (what the other agents check; HOST
must be the name in [[cluster.member]]), and any --address as IP names, for information only: peers
verify the name, because a spare takes over a failed node's address. It serves as server and client.

--operator makes a client-only certificate with the common name operator:NAME for ftctl --cluster.
Agents accept it for the operator operations only (status, snapshots, events, checkpoint, restore),
as root on every agent, and never as a member; a member certificate is refused for those operations.
It is a cluster-admin credential: issue it to a person, keep its key 0600 (ftctl refuses it otherwise).`,
		Args: cli.Args(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			name := args[0]
			if err := clustertls.ValidateMemberName(name); err != nil {
				return cli.Usagef("%s: %v", name, err)
			}
			var ips []netip.Addr
			for _, a := range addrs {
				ip, err := netip.ParseAddr(a)
				if err != nil {
					return cli.Usagef("--address %q: use an IP address", a)
				}
				ips = append(ips, ip)
			}
			if operator && len(ips) > 0 {
				return cli.Usagef("--address does not apply to an operator certificate")
			}
			ca, err := loadCA(dir)
			if err != nil {
				return err
			}
			fileName := name
			var certPEM, keyPEM []byte
			if operator {
				fileName = "operator-" + name
				certPEM, keyPEM, err = ca.IssueOperator(name, valid)
			} else {
				certPEM, keyPEM, err = ca.Issue(name, ips, valid)
			}
			if err != nil {
				return fmt.Errorf("pki issue: %w", err)
			}
			if out == "" {
				out = filepath.Join(dir, fileName)
			}
			if err := privateDir(out); err != nil {
				return err
			}
			for _, f := range []string{caCertName, fileName + ".crt", fileName + ".key"} {
				if err := noLink(filepath.Join(out, f)); err != nil {
					return err
				}
			}
			if err := sameIdentity(filepath.Join(out, fileName+".crt"), certPEM); err != nil {
				return err
			}
			files, err := clustertls.WriteFiles(out, fileName, ca.CertPEM(), certPEM, keyPEM)
			if err != nil {
				return fmt.Errorf("pki issue: %w", err)
			}
			what := "member " + name
			if operator {
				what = "operator " + name
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "certificate for %s issued, valid %s:\n", what, validity{&valid})
			fmt.Fprintf(w, "  ca   = %q\n  cert = %q\n  key  = %q\n", files.CAFile, files.CertFile, files.KeyFile)
			return nil
		},
	}
	cmd.Flags().StringVar(&dir, "dir", "", "directory of the CA (from pki init)")
	cmd.Flags().StringVar(&out, "out", "", "output directory (default DIR/HOST; created 0700)")
	cmd.Flags().StringSliceVar(&addrs, "address", nil, "an IP address of the host, added as an IP name (repeat or comma-separate)")
	cmd.Flags().BoolVar(&operator, "operator", false, "issue an operator's client certificate instead of a member's")
	cmd.Flags().Var(validity{&valid}, "validity", "how long the certificate is valid: days (365d) or a Go duration; at most the CA's")
	cmd.MarkFlagRequired("dir")
	return cmd
}

func newPKIRevokeCmd() *cobra.Command {
	var dir string
	var serials []string
	cmd := &cobra.Command{
		Use:   "revoke --dir DIR CERT... | revoke --dir DIR --serial HEX...",
		Short: "Revoke member or operator certificates: add them to the CA's revocation list DIR/cluster_ca.crl",
		Long: `Add certificates (given as their .crt files, or by serial number in hexadecimal, as openssl x509 -serial
prints it) to the revocation list of the CA in DIR, signed by it: DIR/cluster_ca.crl (0644), replaced
atomically and kept across calls. Copy it to every host and to every operator's --cluster file, as
[cluster] crl = "/etc/ftkit/pki/cluster_ca.crl" (ftctl: crl = ...): agents and ftctl then refuse a listed
certificate at its next connection, member or operator, without a restart. Connections already open
keep going until they close; restart the agents to cut them at once. Revoke the certificate of a host
that was stolen or retired, or an operator's whose key may be lost; re-issue the others as needed.`,
		Args: cli.Args(cobra.ArbitraryArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			var revoke []*big.Int
			certs := map[string]*x509.Certificate{} // by file, checked against the CA once it is loaded
			for _, s := range serials {
				n, ok := new(big.Int).SetString(strings.TrimPrefix(strings.ReplaceAll(strings.ToLower(s), ":", ""), "0x"), 16)
				if !ok || n.Sign() <= 0 {
					return cli.Usagef("--serial %q: give a positive hexadecimal serial number", s)
				}
				revoke = append(revoke, n)
			}
			for _, p := range args {
				b, err := readNoFollow(p)
				if err != nil {
					return cli.Usagef("certificate %s: %v", p, err)
				}
				cert, err := parseCertPEM(b)
				if err != nil {
					return cli.Usagef("%s: %v", p, err)
				}
				revoke = append(revoke, cert.SerialNumber)
				certs[p] = cert
			}
			if len(revoke) == 0 {
				return cli.Usagef("name the certificates to revoke: their files, or --serial")
			}
			ca, err := loadCA(dir)
			if err != nil {
				return err
			}
			// Nor its CA: agents check a chain against the lists but for its trust anchor, which only the CA
			// file withdraws. Listed, the CA's serial was reported revoked while all it issued stayed admitted.
			caCert, err := parseCertPEM(ca.CertPEM())
			if err != nil {
				return fmt.Errorf("pki revoke: the CA's certificate: %w", err)
			}
			for _, n := range revoke {
				if n.Cmp(caCert.SerialNumber) == 0 {
					return cli.Usagef("serial %X is the CA's own certificate, which its revocation list cannot revoke: withdraw the CA by taking it out of every host's CA file", n)
				}
			}
			// A list revokes its own CA's certificates only: one another CA issued would stay admitted.
			for p, cert := range certs {
				if err := ca.Signed(cert); err != nil {
					return cli.Usagef("%s was not issued by the CA in %s (revoke it with its own CA's --dir): %v", p, dir, err)
				}
			}
			path := filepath.Join(dir, crlName)
			if err := noLink(path); err != nil {
				return err
			}
			prev, err := readNoFollowMax(path, maxCRL)
			if err != nil && !errors.Is(err, fs.ErrNotExist) {
				return fmt.Errorf("pki revoke: %w", err)
			}
			crl, err := ca.Revoke(prev, revoke, time.Now())
			if err != nil {
				return fmt.Errorf("pki revoke: %w", err)
			}
			if err := atomicfile.WriteFile(path, crl, 0o644); err != nil {
				return fmt.Errorf("pki revoke: %w", err)
			}
			w := cmd.OutOrStdout()
			for _, n := range revoke {
				fmt.Fprintf(w, "revoked serial %X\n", n)
			}
			fmt.Fprintf(w, "revocation list: %s; copy it to every host ([cluster] crl) and operator (crl in the --cluster file)\n", path)
			return nil
		},
	}
	cmd.Flags().StringVar(&dir, "dir", "", "directory of the CA (from pki init)")
	cmd.Flags().StringSliceVar(&serials, "serial", nil, "a certificate's serial number in hexadecimal (repeat or comma-separate)")
	cmd.MarkFlagRequired("dir")
	return cmd
}

// privateDir makes sure dir is a directory of this user's only this user can access, creating it 0700 if
// missing. A symbolic link is refused rather than followed: keys written through one would land where its
// author chose; so is a directory of another user's, who would read the keys root writes there.
func privateDir(dir string) error {
	fi, err := os.Lstat(dir)
	if errors.Is(err, fs.ErrNotExist) {
		if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
			return fmt.Errorf("create %s: %w", filepath.Dir(dir), err)
		}
		if err := os.Mkdir(dir, 0o700); err != nil {
			return fmt.Errorf("create %s: %w", dir, err)
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("check %s: %w", dir, err)
	}
	switch {
	case fi.Mode()&fs.ModeSymlink != 0:
		return fmt.Errorf("%s is a symbolic link: give the real directory", dir)
	case !fi.IsDir():
		return fmt.Errorf("%s is not a directory", dir)
	case fi.Mode().Perm()&0o077 != 0:
		return fmt.Errorf("%s is accessible to other users (mode %04o) and would hold private keys: chmod 700 it", dir, fi.Mode().Perm())
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && int(st.Uid) != os.Geteuid() {
		return fmt.Errorf("%s is owned by uid %d, who would read the private keys written there: give a directory of uid %d's (chown it, or another path)", dir, st.Uid, os.Geteuid())
	}
	return nil
}

// sameIdentity refuses to replace the certificate at path (and the key beside it) unless it names the
// identity certPEM does: a renewal replaces its own files, but operator NAME's files (operator-NAME.crt) and
// those of a member named operator-NAME are the same paths, and one must not silently take the other's place
// (a member's cluster-root key handed out as an operator's, or an operator's installed on a host).
func sameIdentity(path string, certPEM []byte) error {
	old, err := readNoFollow(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("pki issue: %w", err)
	}
	prev, err := parseCertPEM(old)
	if err != nil {
		return fmt.Errorf("pki issue: %s exists and is not a certificate (%w): remove it or choose another --out", path, err)
	}
	next, err := parseCertPEM(certPEM)
	if err != nil {
		return fmt.Errorf("pki issue: the new certificate: %w", err)
	}
	if prev.Subject.CommonName != next.Subject.CommonName {
		return cli.WithCode(cli.ExitUnavailable, fmt.Errorf("pki issue: %s holds the certificate of %q, not %q: remove it or choose another --out",
			path, prev.Subject.CommonName, next.Subject.CommonName))
	}
	return nil
}

// parseCertPEM parses the first PEM block of b, which must be a certificate.
func parseCertPEM(b []byte) (*x509.Certificate, error) {
	blk, _ := pem.Decode(b)
	if blk == nil || blk.Type != "CERTIFICATE" {
		return nil, errors.New("not a PEM certificate")
	}
	return x509.ParseCertificate(blk.Bytes)
}

// noLink refuses a target that is anything but a regular file: the files are replaced by rename, which
// never follows a link, but a link there means someone is up to something.
func noLink(path string) error {
	fi, err := os.Lstat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil
	case err != nil:
		return fmt.Errorf("check %s: %w", path, err)
	case !fi.Mode().IsRegular():
		return fmt.Errorf("%s exists and is not a regular file (mode %s): remove it", path, fi.Mode())
	}
	return nil
}

// readNoFollow reads a small file without following a symbolic link in its last component.
func readNoFollow(path string) ([]byte, error) { return readNoFollowMax(path, maxPEM) }

func readNoFollowMax(path string, maxSize int) ([]byte, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, int64(maxSize)+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	if len(b) > maxSize {
		return nil, fmt.Errorf("%s is larger than %d bytes: not a file of the pki directory", path, maxSize)
	}
	return b, nil
}

func loadCA(dir string) (*clustertls.CA, error) {
	certPEM, err := readNoFollow(filepath.Join(dir, caCertName))
	if err != nil {
		return nil, fmt.Errorf("load CA (create it with ftctl pki init --dir %s): %w", dir, err)
	}
	keyPEM, err := readNoFollow(filepath.Join(dir, caKeyName))
	if err != nil {
		return nil, fmt.Errorf("load CA (create it with ftctl pki init --dir %s): %w", dir, err)
	}
	ca, err := clustertls.LoadCA(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("load CA from %s: %w", dir, err)
	}
	return ca, nil
}
