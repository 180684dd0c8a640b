package clustertls

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
)

// parseCertsPEM decodes every CERTIFICATE block in data. Text outside PEM
// blocks is tolerated (openssl -text output puts a preamble there), but a
// block of another type or a damaged block is an error, so a truncated or
// mixed-up file is reported instead of silently yielding fewer certificates.
func parseCertsPEM(data []byte) ([]*x509.Certificate, error) {
	var certs []*x509.Certificate
	rest := data
	for {
		var block *pem.Block
		block, rest = pem.Decode(rest)
		if block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			return nil, fmt.Errorf("found a PEM %q block where only CERTIFICATE blocks are expected", block.Type)
		}
		cert, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("certificate block %d: %w", len(certs)+1, err)
		}
		// x509 parses unknown key algorithms with a nil key; say so here
		// rather than as a puzzling key mismatch later.
		if cert.PublicKey == nil {
			return nil, fmt.Errorf("certificate block %d: unsupported public key algorithm %v", len(certs)+1, cert.PublicKeyAlgorithm)
		}
		certs = append(certs, cert)
	}
	if bytes.Contains(rest, []byte("-----BEGIN")) {
		return nil, fmt.Errorf("damaged PEM block after %d good certificate(s) (bad base64 or missing END line)", len(certs))
	}
	if len(certs) == 0 {
		return nil, errors.New("no PEM CERTIFICATE block found")
	}
	return certs, nil
}

// parseKeyPEM decodes exactly one unencrypted private key (PKCS#8 or SEC 1).
func parseKeyPEM(data []byte) (crypto.Signer, error) {
	block, rest := pem.Decode(data)
	if block == nil {
		return nil, errors.New("no PEM private key block found (bad base64 or missing BEGIN/END line?)")
	}
	if bytes.Contains(rest, []byte("-----BEGIN")) {
		return nil, errors.New("more than one PEM block; a key file must hold exactly one private key")
	}
	var (
		key any
		err error
	)
	switch block.Type {
	case "PRIVATE KEY":
		key, err = x509.ParsePKCS8PrivateKey(block.Bytes)
	case "EC PRIVATE KEY":
		key, err = x509.ParseECPrivateKey(block.Bytes)
	case "ENCRYPTED PRIVATE KEY":
		return nil, errors.New("encrypted private keys are not supported; store the key unencrypted with mode 0600")
	default:
		return nil, fmt.Errorf("found a PEM %q block, expected PRIVATE KEY or EC PRIVATE KEY", block.Type)
	}
	if err != nil {
		return nil, fmt.Errorf("parse %s: %w", block.Type, err)
	}
	signer, ok := key.(crypto.Signer)
	if !ok {
		return nil, fmt.Errorf("unsupported private key type %T", key)
	}
	return signer, nil
}

// parseECDSAKeyPEM is parseKeyPEM restricted to ECDSA, the only CA key type we issue with.
func parseECDSAKeyPEM(data []byte) (*ecdsa.PrivateKey, error) {
	signer, err := parseKeyPEM(data)
	if err != nil {
		return nil, err
	}
	key, ok := signer.(*ecdsa.PrivateKey)
	if !ok {
		return nil, fmt.Errorf("private key is %T, expected ECDSA", signer)
	}
	return key, nil
}

// publicKeysMatch reports whether key is the private half of pub.
func publicKeysMatch(key crypto.Signer, pub crypto.PublicKey) bool {
	k, ok := key.Public().(interface{ Equal(crypto.PublicKey) bool })
	return ok && k.Equal(pub)
}

func encodeCertPEM(der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

func encodeKeyPEM(key *ecdsa.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("marshal private key: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}
